"""What the tests of `specchat serve` share: the real server in a subprocess (uvicorn on a free loopback
port), its log, the official `openai` client and httpx pointed at it, and the checks of OpenAI's shapes.

tests/conftest.py's `server` fixture (the tiny pair, served with API_KEY) starts one per test module with
`start_server`; tests/test_serve*.py and tests/test_prompt_cache.py use the rest.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key"
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True)
class Served:
    """A running `specchat serve`: its process, port and log, and clients pointed at it."""

    proc: subprocess.Popen[str]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def post(self, path: str, body: object, api_key: str | None = API_KEY, **kw: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers={"Content-Type": "application/json", **headers},
                          timeout=120, **kw)

    def health(self) -> dict[str, object]:
        return httpx.get(f"{self.url}/health", timeout=10).json()


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], log_path: Path, threads: str = "1", timeout: float = 300) -> Served:
    """`python -m app serve ARGS` on a free port, its output in `log_path`; returned once /health answers."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", *args, "--port", str(port), "-t", threads],
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    served = Served(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{served.log()}")
        try:
            if httpx.get(f"{served.url}/health", timeout=2).status_code == 200:
                assert f"http://127.0.0.1:{port}/v1" in served.log()  # the startup line names the URL
                return served
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the server did not answer /health in {timeout} s:\n{served.log()}")


def stop_server(served: Served) -> None:
    """Ctrl-C: uvicorn's shutdown, then the engine is freed and the process exits 0."""
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGINT)
        try:
            served.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            raise
    assert served.proc.returncode == 0, served.log()
    assert "specchat serve: stopped" in served.log()
    log = served.log()
    assert log.count("Traceback") <= log.count("generation failed"), "a traceback no failed generation explains"


def at_once(served: Served, calls: Sequence[Callable[[], object]]) -> tuple[list[object], int]:
    """Each call on a thread of its own, all started together: what each returned (or the exception it raised),
    and the most requests the server's /health showed running meanwhile."""
    got: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            got[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - the caller's assertions report it
            got[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    most = 0
    while any(t.is_alive() for t in threads):
        most = max(most, served.health()["running"])
        time.sleep(0.005)
    for t in threads:
        t.join()
    return got, most


def timings_of(obj: object) -> dict[str, object]:
    """The llama-server-shaped `timings` an answer or chunk carries beside OpenAI's fields."""
    extra = getattr(obj, "model_extra", None) or {}
    assert "timings" in extra, obj
    return extra["timings"]


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> str:
    """`r` is OpenAI's error shape with this status (and code, param); its message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


def spec(strategy: str, **settings: object) -> dict[str, object]:
    """A request's `speculative` field: the strategy and its settings."""
    return {"speculative": {"strategy": strategy, **settings}}

