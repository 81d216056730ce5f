"""`specchat serve` when things go wrong, as a client sees it: OpenAI's error shape for 400 / 401 / 404 / 413;
a request that fails inside its generation (a 400 or a 500, streamed or not) leaves the server up for the
next one; a client that disconnects mid-stream cancels its generation; Ctrl-C stops the server cleanly
mid-stream; listening beyond loopback warns first. The real server in a subprocess (tests/serve_helpers.py),
except for the 500, which needs a failing engine in-process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx
import openai
import pytest
from serve_helpers import API_KEY, Served, assert_error, free_port, spec, start_server, stop_server

from app.serve import EngineWorker, ServerConfig, make_app
from app.settings import Settings
from backends.events import Done, GenStats, Prefilled

T = TypeVar("T")


def test_api_key_required(server: Served) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200  # open for load balancers and scripts
    for key in (None, "wrong"):
        assert_error(server.post("/v1/completions", {"prompt": "hi"}, api_key=key), 401, "invalid_api_key")
    assert_error(httpx.get(f"{server.url}/v1/models"), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").completions.create(model="target", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401


def test_bad_requests_have_openai_error_shape(server: Served) -> None:
    assert_error(server.post("/v1/completions", b"{not json"), 400, "invalid_json")
    assert_error(server.post("/v1/completions", b"[1, 2]"), 400, "invalid_json")
    assert_error(server.post("/v1/completions", b"\xff\xfe"), 400, "invalid_json")
    with pytest.raises(openai.NotFoundError) as e:
        server.client().completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404
    assert_error(server.post("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}), 404, "model_not_found", "model")
    cases = [
        ({"prompt": "hi", "n": 5}, "n"),  # more choices than the 4 slots decoding at once
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "logprobs": 6}, "logprobs"),
        ({"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
        ({"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "stop": [1]}, "stop"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "hi", "speculative": {"strategy": "medusa"}}, "speculative.strategy"),
        ({"prompt": "hi", "speculative": {"strategy": "lookahead", "depth": 3}}, "speculative.depth"),
        ({"prompt": "hi", "speculative": {"strategy": "lookahead", "window": 0}}, "speculative"),  # __post_init__
        ({"prompt": "hi", "speculative": {"strategy": "lookahead", "window": "wide"}}, "speculative.window"),
        ({"prompt": "hi", "speculative": {"strategy": "sps", "n_max": 0}}, "speculative.n_max"),
        ({"prompt": "hi", "speculative.n_min": 4}, "speculative.n_min"),
        ({"prompt": "hi", "speculative": {"strategy": "tree", "depth": 9, "top_k": 4, "nodes": 70}}, "speculative"),
    ]
    for body, param in cases:
        assert_error(server.post("/v1/completions", body), 400, param=param)
    assert_error(server.post("/v1/chat/completions", {"messages": []}), 400, param="messages")
    assert_error(server.post("/v1/completions", {"messages": [{"role": "user", "content": "x"}]}), 400,
                 param="messages")
    r = httpx.get(f"{server.url}/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"})
    assert_error(r, 404, "not_found")


def test_prompt_over_the_context_is_400(server: Served) -> None:
    r = server.post("/v1/completions", {"prompt": "the cat " * 3000, "max_tokens": 4})
    assert "context" in assert_error(r, 400)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="target", prompt="the cat " * 3000, max_tokens=4, stream=True)


def test_request_body_limit_is_413(server: Served) -> None:
    r = server.post("/v1/completions", {"prompt": "a" * (2 << 20)})
    assert_error(r, 413, "request_too_large")
    assert server.client().completions.create(model="target", prompt="hi", max_tokens=2,
                                              temperature=0).usage.completion_tokens == 2


def test_failing_request_does_not_take_the_server_down(server: Served) -> None:
    """A draft longer than the batch fails inside the generation (after the prefill), streamed or not."""
    body = {"prompt": "the cat", "max_tokens": 600, "temperature": 0,
            "speculative": {"strategy": "sps", "n_max": 520, "p_min": 0.0, "adaptive": False}}
    assert "batch" in assert_error(server.post("/v1/completions", body), 400)
    client = server.client()
    with pytest.raises(openai.APIError) as e:
        for _ in client.completions.create(model="target", prompt="the cat", max_tokens=600, temperature=0,
                                           stream=True, extra_body={"speculative": body["speculative"]}):
            pass
    assert "batch" in str(e.value) and "Traceback" not in str(e.value)
    after = client.completions.create(model="target", prompt="the cat", max_tokens=8, temperature=0,
                                      extra_body=spec("sps"))
    assert after.usage.completion_tokens == 8 and server.health()["status"] == "ok"


def _within(seconds: float, call: Callable[[], T]) -> T:
    """`call()`'s result, or a failure when it has not returned after `seconds`. Starlette's in-process
    TestClient has no timeout of its own (it warns that `timeout=` is ignored), and a request that never
    answers must fail the test rather than hang it: the call runs on a daemon thread, abandoned if it hangs."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - raised again on the test's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"no answer within {seconds:g} s")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]


def test_generation_error_is_a_500_and_the_next_request_runs(tiny_engine) -> None:
    """Done(reason="error") (a llama.cpp failure mid-generation) answers 500 with one line, in-process."""
    from starlette.testclient import TestClient

    class FailingStrategy:
        name = "ar"
        in_prefill = False  # True: fail while the prompt is decoded, before any Prefilled

        def steps(self, prompt, params, should_stop):
            if not self.in_prefill:
                yield Prefilled(len(prompt), 0.0)
            yield Done("error", GenStats("ar", len(prompt), 0, 0.0, 0, 0.0, 0, 0, 0), (), "", error="decode failed")

    class Engine:
        def __init__(self, engine) -> None:
            self._engine, self.fail = engine, True

        def __getattr__(self, name: str):
            return getattr(self._engine, name)

        def strategy(self, name, options, slot=0):
            return FailingStrategy() if self.fail else self._engine.strategy(name, options, slot)

    engine = Engine(tiny_engine)
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    worker.start()
    try:
        app = make_app(ServerConfig(defaults=Settings(target="t", strategy="ar"), model_ids=("t",)), worker)
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 4})
            assert r.status_code == 500 and r.json()["error"]["message"] == "the generation failed: decode failed"
            with client.stream("POST", "/v1/completions", json={"prompt": "the cat", "stream": True}) as s:
                lines = [line for line in s.iter_lines() if line]
            assert json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "generation_failed"
            FailingStrategy.in_prefill = True  # the answer must come all the same, not hang
            r = _within(30, lambda: client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 4}))
            assert r.status_code == 500 and r.json()["error"]["message"] == "the generation failed: decode failed"

            def stream_chat() -> tuple[int, bytes]:
                with client.stream("POST", "/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as s:
                    return s.status_code, s.read()

            status, body = _within(30, stream_chat)
            assert status == 500 and json.loads(body)["error"]["code"] == "generation_failed"
            engine.fail = False
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        worker.stop()


def test_disconnect_cancels_the_generation(server: Served) -> None:
    client = server.client()
    before = server.health()["cancelled"]
    stream = client.completions.create(model="target", prompt="the cat sat", max_tokens=4000, temperature=0,
                                       stream=True, extra_body={**spec("ar"), "ignore_eos": True})
    chunks = [next(iter(stream)), next(iter(stream))]
    assert len(chunks) == 2
    stream.close()
    t0 = time.monotonic()
    r = client.completions.create(model="target", prompt="hello", max_tokens=8, temperature=0)
    elapsed = time.monotonic() - t0
    assert r.usage.completion_tokens == 8
    assert elapsed < 5.0, elapsed  # 4000 tokens take about 10 s on one thread: the first did not run on
    assert server.health()["cancelled"] == before + 1
    counts = [int(n) for n in re.findall(r"text ar: (\d+) tokens \(cancelled\)", server.log())]
    assert counts and counts[-1] < 4000



def test_ctrl_c_mid_stream_stops_cleanly(tiny, tmp_path: Path) -> None:
    served = start_server(["-m", str(tiny.target), "-s", "ar"], tmp_path / "server.log")
    got: list[str] = []

    def read() -> None:
        try:
            # ignore_eos: the answer runs to 4000 tokens unless the Ctrl-C ends it, however slow the machine.
            for chunk in served.client().completions.create(model="target", prompt="the cat", max_tokens=4000,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
                got.append(chunk.choices[0].text if chunk.choices else "")
        except (openai.APIError, httpx.HTTPError):
            pass

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 60
    while len(got) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got
    t0 = time.monotonic()
    stop_server(served)  # asserts exit 0 and "stopped"
    reader.join(30)
    assert time.monotonic() - t0 < 15 and len(got) < 4000
    assert "(cancelled)" in served.log()


def test_other_hosts_warn(tiny, tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the warning comes first, then a clean failure to bind.
    r = subprocess.run([sys.executable, "-m", "app", "serve", "-m", str(tiny.target), "--host", "192.0.2.1",
                        "--port", str(free_port()), "-t", "1"], capture_output=True, text=True, timeout=300)
    assert "warning: listening on 192.0.2.1" in r.stderr and "without --api-key" in r.stderr
    assert r.returncode == 2 and "cannot serve on 192.0.2.1" in r.stderr



def test_a_new_machines_server_says_it_measures_before_it_listens(tiny, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Several slots: the batch cost is measured before serving (~15 s for SmolLM2 on 2 cores). The first start on
    # a machine says so rather than sit silent; a later start reads the costs kept on disk and does not.
    monkeypatch.setenv("SPECCHAT_COST_CACHE", str(tmp_path / "device-cost.json"))
    logs = []
    for start in range(2):
        served = start_server(["-m", str(tiny.target), "-md", str(tiny.draft), "-np", "2"],
                              tmp_path / f"server{start}.log")
        stop_server(served)
        logs.append(served.log())
    first, later = logs
    assert "measuring this machine's batch cost" in first
    assert first.index("measuring this machine's batch cost") < first.index(" on http://127.0.0.1:")  # before the URL
    assert "measuring" not in later and (tmp_path / "device-cost.json").exists()
