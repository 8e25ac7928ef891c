"""The CLI's redaction: a DSN or Redis URL is never printed with its password."""

from __future__ import annotations

import pytest
import typer

from touba.cli._common import redact, run, scrub
from touba.errors import ConfigurationError


@pytest.mark.parametrize(
    ("address", "shown"),
    [
        ("postgresql://user:secret@host/db", "postgresql://user:***@host/db"),
        (
            "postgres://u:p%40ss@h:5432/d?sslmode=require",
            "postgres://u:***@h:5432/d?sslmode=require",
        ),
        ("postgresql://u:pa#ss?x@host/db", "postgresql://u:***@host/db"),  # raw '#', '?' too
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        (
            "postgresql://host/db?password=xyz&sslmode=a",
            "postgresql://host/db?password=***&sslmode=a",
        ),
        (
            "postgresql:///db?host=/run/pg&sslpassword=k",
            "postgresql:///db?host=/run/pg&sslpassword=***",
        ),
        ("host=h password=secret dbname=x", "host=h password=*** dbname=x"),
        ("host=h password = 'se cr\\'et' dbname=x", "host=h password = *** dbname=x"),
        ("password=secret", "password=***"),
        ("sslpassword=k host=h", "sslpassword=*** host=h"),
        ("host=h dbname=x", "host=h dbname=x"),
        ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://default:secret@host", "rediss://default:***@host"),
        ("unix://:secret@/tmp/redis.sock?db=0", "unix://:***@/tmp/redis.sock?db=0"),
        ("redis://host/0?password=abc", "redis://host/0?password=***"),
        ("redis://host:6379/0", "redis://host:6379/0"),
    ],
)
def test_redact_masks_every_password(address: str, shown: str) -> None:
    assert redact(address) == shown


def test_scrub_masks_the_secret_wherever_a_message_quotes_it() -> None:
    dsn = "postgresql://u:p%40ss word@h/db"
    message = f'bad {dsn}: unexpected spaces in "p%40ss word" ("p@ss word")'
    assert (
        scrub(message, [dsn]) == 'bad postgresql://u:***@h/db: unexpected spaces in "***" ("***")'
    )
    quoted = "host=h password='it\\'s'"
    assert scrub("it's here", [quoted]) == "*** here"


@pytest.mark.parametrize("error", [ConfigurationError, OSError])
def test_run_masks_the_secret_in_any_error_it_prints(
    error: type[Exception], capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = "postgresql://u:hunter2@h/db"

    async def fail() -> None:
        raise error(f"lost {dsn} (password hunter2)")

    with pytest.raises(typer.Exit) as exited:
        run(fail(), secret=[dsn], driver_errors=(OSError,))
    assert exited.value.exit_code == 1
    printed = capsys.readouterr().err.replace("\n", "")
    assert f"{error.__name__}: lost postgresql://u:***@h/db (password ***)" in printed
    assert "hunter2" not in printed
