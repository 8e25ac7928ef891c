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


RETRYABLE = {
    "AgentDecisionProviderUnavailable",
    "CheckpointStoreUnavailable",
    "DecisionHistoryBusy",
    "DecisionHistoryStoreUnavailable",
    "InvocationBusy",
    "MemoryStoreUnavailable",
    "ProviderContextCountUnavailable",
    "ResourceBindingUnavailable",
}


def _sample(cls: type[errors.ToubaError]) -> errors.ToubaError:
    extras: dict[str, dict[str, object]] = {
        "AgentDecisionProviderSchemaViolation": {"provider_error_code": "x"},
        "AgentBudgetExceeded": {"max_decisions": 1},
        "DecisionHistoryBusy": {"session_key": "k"},
        "DecisionHistoryLimitExceeded": {"limit": "max_bytes"},
        "ExtractionLeaseLost": {"job_id": "j"},
        "FlowStepFailed": {"step": "s"},
        "InvocationBusy": {"checkpoint_id": "c", "holder": {}},
        "ResourceAccessDenied": {"resource": "r", "operation": "get", "reason": "no_scope_key"},
    }
    return cls("message", **extras.get(cls.__name__, {}))


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n in errors.__all__
        if n.endswith(
            (
                "Error",
                "Busy",
                "Unavailable",
                "Exceeded",
                "Mismatch",
                "Invalid",
                "Unsafe",
                "Unsupported",
                "Violation",
                "Lost",
                "Failed",
                "Denied",
            )
        )
    ),
)
def test_which_errors_are_retryable_as_the_readme_says(name: str) -> None:
    error = _sample(getattr(errors, name))
    assert error.retryable is (name in RETRYABLE)


@pytest.mark.parametrize(
    ("limit", "retryable"),
    [
        ("max_sessions", True),
        ("max_store_bytes", True),
        ("max_messages", False),
        ("max_bytes", False),
        ("max_retained_bytes", False),
    ],
)
def test_a_full_store_is_retryable_a_bound_of_the_step_is_not(limit: str, retryable: bool) -> None:
    error = errors.DecisionHistoryLimitExceeded("full", limit=limit)  # type: ignore[arg-type]
    assert error.retryable is retryable


@pytest.mark.parametrize(
    "cls", [errors.AgentDecisionProviderUnavailable, errors.ProviderContextCountUnavailable]
)
def test_a_provider_error_keeps_the_servers_message_apart_and_bounded(
    cls: type[errors.AgentDecisionProviderUnavailable],
) -> None:
    said = "bad\x00 field\r\n\tmessages.1\u202e.content\x1b[0m " + "y" * 1000
    error = cls("HTTP 400; fix the request", status_code=400, server_message=said, retryable=False)
    assert error.message == "HTTP 400; fix the request"  # what traces and records get
    assert error.server_message is not None
    assert error.server_message.startswith("bad field   messages.1.content[0m yyy")
    assert len(error.server_message) == 500
    assert error.server_message.endswith("...")
    assert all(c.isprintable() for c in error.server_message)
    assert str(error) == f'HTTP 400; fix the request (the server said: "{error.server_message}")'
    assert (error.status_code, error.retryable) == (400, False)


@pytest.mark.parametrize("said", [None, "", " \n\x00 "])
def test_no_server_message_reads_as_none(said: str | None) -> None:
    error = errors.AgentDecisionProviderUnavailable("no answer", server_message=said)
    assert error.server_message is None
    assert str(error) == "no answer"
    assert error.retryable  # the default: the transport failed


def test_a_short_server_message_is_kept_whole() -> None:
    said = "x" * 500
    assert errors.AgentDecisionProviderUnavailable("m", server_message=said).server_message == said
