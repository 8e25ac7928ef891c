"""Fixtures of the real-server suite: llama-cpp-python's own OpenAI-compatible server.

Every test here is marked ``real_server`` and left out of the default run (pyproject's
``addopts`` deselects the marker); ``make real-servers`` builds or reuses the
llama-cpp-python wheel (``build_llama.py``) and runs them with ``-m real_server``.

- ``tiny_model``: the GGUF model of ``_model.py``, written once per session.
- ``llama_server``: one ``python -m llama_cpp.server`` per chat format (the model's own
  template, ``chatml``, ``chatml-function-calling``), on a free loopback port, started
  once per session and stopped at its end. ``start_server`` starts one of a test's own
  (with ``--api_key`` or other flags, or to be killed).
- ``sent``: every body the compatible wire sends, as it is sent.

When the CPU lacks AVX2, a build tool is missing, or llama-cpp-python (the pinned
version) or ``gguf`` is not installed, the tests skip with the reason, except under
``CI=true``, where they fail.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import importlib.util
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._services import unavailable
from tests.real_servers import build_llama
from touba.providers.compatible import CompatibleWire

# The chat formats each test runs on: None is the model's own (Jinja) template.
FORMATS: tuple[str | None, ...] = (None, "chatml", "chatml-function-calling")
FORMAT_IDS = ("own-template", "chatml", "chatml-function-calling")
MODEL_ALIAS = "tiny"
READY_SECONDS = 120.0
STOP_SECONDS = 10.0


def _prerequisites() -> str | None:
    """Why the suite cannot run here, or None."""
    reason = build_llama.cpu_unsupported()
    if reason is not None:
        return reason
    try:
        installed = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        missing = build_llama.missing_build_tool()
        if missing is not None:
            return missing
        return "llama-cpp-python is not installed: run `make real-servers`"
    if installed != build_llama.VERSION:
        return (
            f"llama-cpp-python {installed} is installed, the suite is pinned to "
            f"{build_llama.VERSION}: run `make real-servers`"
        )
    for module in ("gguf", "numpy", "uvicorn", "fastapi", "sse_starlette", "starlette_context"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed: run `make real-servers`"
    return None


@pytest.fixture(scope="session")
def _ready() -> None:
    reason = _prerequisites()
    if reason is not None:
        unavailable(reason)


@pytest.fixture(scope="session")
def tiny_model(_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.real_servers._model import write_model

    return write_model(tmp_path_factory.mktemp("model") / "tiny.gguf")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LlamaServer:
    """One ``python -m llama_cpp.server`` process on 127.0.0.1."""

    def __init__(
        self,
        model: Path,
        log: Path,
        chat_format: str | None,
        api_key: str | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.chat_format = chat_format
        self.api_key = api_key
        self.port = _free_port()
        self.log = log
        command = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--model_alias",
            MODEL_ALIAS,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_ctx",
            "8192",  # byte-level tokens: a structured prompt alone is a few thousand
            "--n_threads",
            "1",
            "--n_threads_batch",
            "1",
            "--seed",
            "7",
            "--verbose",
            "False",
        ]
        if chat_format is not None:
            command += ["--chat_format", chat_format]
        if api_key is not None:
            command += ["--api_key", api_key]
        command += extra
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(
            command, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, size: int = 3000) -> str:
        self._log_file.flush()
        return self.log.read_bytes()[-size:].decode(errors="replace")

    def wait_ready(self) -> LlamaServer:
        """Poll ``GET /v1/models`` until it answers 200; fail with the log if it dies."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(
                    f"llama_cpp.server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                answer = httpx.get(f"{self.base_url}/models", headers=headers, timeout=2.0)
                if answer.status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"llama_cpp.server was not ready in {READY_SECONDS} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: the server dies at once, whatever it was doing."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log_file.close()


@pytest.fixture(scope="session")
def _servers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str | None, LlamaServer]]:
    """The three chat-format servers, started together (they load in parallel)."""
    logs = tmp_path_factory.mktemp("logs")
    servers = {
        chat_format: LlamaServer(tiny_model, logs / f"{name}.log", chat_format)
        for chat_format, name in zip(FORMATS, FORMAT_IDS, strict=True)
    }
    try:
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(params=FORMATS, ids=FORMAT_IDS)
def llama_server(
    request: pytest.FixtureRequest, _servers: dict[str | None, LlamaServer]
) -> LlamaServer:
    return _servers[request.param]


@pytest.fixture
def start_server(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., LlamaServer]]:
    """Start a server of the test's own: ``start_server(chat_format=None, api_key=None,
    *extra_arguments)``."""
    started: list[LlamaServer] = []

    def start(
        chat_format: str | None = None, api_key: str | None = None, *extra: str
    ) -> LlamaServer:
        server = LlamaServer(
            tiny_model, tmp_path / f"server-{len(started)}.log", chat_format, api_key, extra
        )
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every body the compatible wire sends, as sent (a deep copy, in order)."""
    bodies: list[dict[str, Any]] = []
    original = CompatibleWire.generate

    async def generate(self: CompatibleWire, body: dict[str, Any], sink: Any = None) -> Any:
        bodies.append(copy.deepcopy(dict(body)))
        return await original(self, body, sink)

    monkeypatch.setattr(CompatibleWire, "generate", generate)
    return bodies
