import pytest

from touba import errors

SPEC_CLASSES = [
    "AgentDecisionProviderSchemaViolation",
    "AgentDecisionProviderUnavailable",
    "ConfigurationError",
    "DecisionHistoryBusy",
    "DecisionHistoryLimitExceeded",
    "DecisionHistoryMismatch",
    "DecisionHistoryStorageUnsafe",
    "DecisionHistorySummaryInvalid",
    "ProviderContextCountUnavailable",
    "ProviderContextGuardUnsupported",
    "ProviderContextWindowExceeded",
]


@pytest.mark.parametrize("name", SPEC_CLASSES)
def test_every_spec_error_exists_with_its_code(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.ToubaError)
    assert cls.code == name


def test_configuration_error_is_a_value_error() -> None:
    assert issubclass(errors.ConfigurationError, ValueError)


def test_errors_carry_their_attributes() -> None:
    violation = errors.AgentDecisionProviderSchemaViolation(
        "bad json", provider_error_code="bad_json"
    )
    assert violation.provider_error_code == "bad_json"
    assert violation.code == "AgentDecisionProviderSchemaViolation"
    limit = errors.DecisionHistoryLimitExceeded("too big", limit="max_bytes")
    assert limit.limit == "max_bytes"
    busy = errors.DecisionHistoryBusy("held", session_key="k")
    assert busy.session_key == "k"
    assert str(limit) == "too big"


def test_record_invalid_is_a_mismatch() -> None:
    assert issubclass(errors.DecisionHistoryRecordInvalid, errors.DecisionHistoryMismatch)
    assert errors.DecisionHistoryRecordInvalid.code == "DecisionHistoryRecordInvalid"


@pytest.mark.parametrize(
    "cls", [errors.CheckpointStoreUnavailable, errors.ResourceBindingUnavailable]
)
def test_runtime_store_failures_are_retryable(cls: type[errors.ToubaError]) -> None:
    error = cls("server gone")
    assert error.code == cls.__name__
    assert error.retryable
