"""`specchat serve` as a client sees it: the real server in a subprocess (uvicorn on a free loopback
port), spoken to with the official `openai` client and, for raw HTTP cases, httpx.

Covered: chat and completions, streamed and not; temperature-0 output equal to
`specchat run`'s; llama-server-shaped `timings`; per-request strategy switches;
KV cache reuse across chat turns; OpenAI's error shape for 400 / 401 / 404 / 413;
a client that disconnects mid-stream cancels its generation; failing requests
leave the server up; Ctrl-C stops it cleanly. Under load (--parallel 4, the
default): eight clients at once each get the text they get alone, and random
disconnects and bad requests leave every valid request whole.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from engine_helpers import BATCH_NOISE, min_greedy_gap
from gguf_factory import write_llama_gguf

from app.serve import EngineWorker, ServerConfig, make_app
from app.settings import Settings
from backends.events import Done, GenStats, Prefilled

API_KEY = "test-key"
# A chat template in the style of the GGUFs' (role tags around each message, then the assistant's turn opened).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPT = "once upon a time"
N = 24
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True)
class Served:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], log_path: Path, threads: str = "1", timeout: float = 300) -> Served:
    port = _free_port()
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


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_server(["-m", str(tiny.target), "-md", str(tiny.draft), "--api-key", API_KEY],
                          tmp_path_factory.mktemp("serve") / "server.log")
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    d = tmp_path_factory.mktemp("serve-chat")
    model = write_llama_gguf(d / "chat.gguf", chat_template=TEMPLATE)
    served = start_server(["-m", str(model), "-s", "lookup"], d / "server.log")
    yield served
    stop_server(served)


def run_cli(tiny, strategy: str, prompt: str = PROMPT, n: int = N) -> str:
    """`specchat run`'s text for the same prompt and strategy (its stdout ends the text with a newline)."""
    r = subprocess.run([sys.executable, "-m", "app", "run", prompt, "-m", str(tiny.target), "-md", str(tiny.draft),
                        "-s", strategy, "--temp", "0", "--no-color", "-t", "1", "-n", str(n)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    return r.stdout[:-1]


def timings_of(obj: object) -> dict[str, object]:
    extra = getattr(obj, "model_extra", None) or {}
    assert "timings" in extra, obj
    return extra["timings"]


def check_timings(t: dict[str, object], completion_tokens: int, strategy: str) -> None:
    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "draft_n",
                "draft_n_accepted", "strategy", "target_forwards", "tokens_per_forward", "accepted_per_position"):
        assert key in t, key
    assert t["strategy"] == strategy
    assert t["predicted_n"] == completion_tokens
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert sum(t["accepted_per_position"]) == t["draft_n_accepted"]
    assert 1 <= t["target_forwards"] <= completion_tokens + 1
    assert t["tokens_per_forward"] == pytest.approx(completion_tokens / t["target_forwards"], abs=1e-3)
    if strategy == "ar":
        assert t["draft_n"] == 0 and t["tokens_per_forward"] == 1.0


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> str:
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
    return {"speculative": {"strategy": strategy, **settings}}


# -- completions --------------------------------------------------------------


@pytest.mark.parametrize("strategy, stream", [("sps", False), ("lookahead", True), ("ar", True)])
def test_completion_equals_run(server: Served, tiny, strategy: str, stream: bool) -> None:
    client = server.client()
    kw = dict(model="target", prompt=PROMPT, max_tokens=N, temperature=0, extra_body=spec(strategy))
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    else:
        text = client.completions.create(**kw).choices[0].text
    assert text and text == run_cli(tiny, strategy)


def test_completion_usage_and_timings(server: Served) -> None:
    r = server.client().completions.create(model="target", prompt="the dog ran", max_tokens=N, temperature=0,
                                           extra_body=spec("sps"))
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == N and r.usage.total_tokens == r.usage.prompt_tokens + N
    t = timings_of(r)
    check_timings(t, r.usage.completion_tokens, "sps")
    assert t["draft_n"] > 0  # the draft model proposed tokens
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens


def test_streamed_completion_chunks(server: Served) -> None:
    """One chunk per output token, then the finish reason, then usage; the last chunk carries the timings."""
    client = server.client()
    kw = dict(model="target", prompt="the big red house", max_tokens=N, temperature=0, extra_body=spec("lookup"))
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert not last.choices and last.usage is not None
    t = timings_of(last)
    assert len(token_chunks) == t["predicted_n"] == last.usage.completion_tokens == N
    check_timings(t, N, "lookup")
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == client.completions.create(**kw).choices[0].text
    # Without include_usage the finish chunk is the last one and carries the timings.
    plain = list(client.completions.create(stream=True, **kw))
    assert plain[-1].choices[0].finish_reason == "length" and timings_of(plain[-1])["predicted_n"] == N


def test_strategy_per_request_same_greedy_text(server: Served) -> None:
    client = server.client()
    texts = {}
    for strategy in ("ar", "sps", "lookahead", "lookup", "tree"):
        r = client.completions.create(model="target", prompt="the cat sat on the mat", max_tokens=N, temperature=0,
                                      extra_body=spec(strategy))
        check_timings(timings_of(r), r.usage.completion_tokens, strategy)
        texts[strategy] = r.choices[0].text
    assert len(set(texts.values())) == 1 and texts["ar"], texts


def test_strategy_settings_and_llama_server_fields(server: Served) -> None:
    client = server.client()
    base = dict(model="target", prompt="hello world", max_tokens=16, temperature=0)
    r = client.completions.create(**base, extra_body=spec("lookahead", window=4, ngram=4, guesses=3))
    assert timings_of(r)["strategy_settings"] == "lookahead W=4 N=4 G=3"
    # llama-server's flat keys: n_max is K, p_min the draft's stopping probability, n_max 0 plain decoding.
    r = client.completions.create(**base, extra_body={"speculative.n_max": 3, "speculative.p_min": 0.0,
                                                      "speculative": {"strategy": "sps", "adaptive": False}})
    t = timings_of(r)
    assert t["strategy_settings"] == "sps K=3 p_min=0.0 fixed" and len(t["drafted_per_position"]) == 3
    r = client.completions.create(**base, extra_body={"speculative": {"n_max": 0, "n_min": 0}})
    assert timings_of(r)["strategy"] == "ar"


def test_sampling_with_seed_is_reproducible(server: Served) -> None:
    client = server.client()
    kw = dict(model="target", prompt="the dog", max_tokens=N, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "min_p": 0.01, **spec("sps")})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    greedy = client.completions.create(model="target", prompt="the dog", max_tokens=N, temperature=0)
    assert greedy.choices[0].text  # a different request still runs after sampled ones


def test_stop_string_ends_the_text(server: Served) -> None:
    client = server.client()
    full = client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body=spec("ar")).choices[0].text
    stop = full[len(full) // 2:][:3]
    assert stop
    r = client.completions.create(model="target", prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop],
                                  extra_body=spec("ar"))
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]


def test_models_lists_the_target_and_accepts_the_alias(server: Served, tiny) -> None:
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["target"]
    r = client.completions.create(model=str(tiny.target), prompt="hi", max_tokens=2, temperature=0)
    assert r.model == str(tiny.target) and r.usage.completion_tokens == 2


# -- chat ---------------------------------------------------------------------------


def test_chat_streamed_and_not(chat_server: Served) -> None:
    client = chat_server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]
    r = client.chat.completions.create(model="chat", messages=messages, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    check_timings(timings_of(r), r.usage.completion_tokens, "lookup")
    without_system = client.chat.completions.create(model="chat", messages=messages[1:], max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > without_system.usage.prompt_tokens  # the system message went through the template
    chunks = list(client.chat.completions.create(model="chat", messages=messages, max_tokens=N, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens == timings_of(chunks[-1])["predicted_n"]


def test_chat_reuses_the_cache_across_turns(chat_server: Served) -> None:
    client = chat_server.client()
    first = [{"role": "user", "content": "hello world"}]
    a = client.chat.completions.create(model="chat", messages=first, max_tokens=12, temperature=0,
                                       extra_body=spec("ar"))
    second = [*first, {"role": "assistant", "content": a.choices[0].message.content},
              {"role": "user", "content": "and the dog?"}]
    b = client.chat.completions.create(model="chat", messages=second, max_tokens=12, temperature=0,
                                       extra_body=spec("lookahead"))
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached >= a.usage.prompt_tokens, (cached, a.usage.prompt_tokens)  # the whole first turn was reused
    assert timings_of(b)["cache_n"] == cached and timings_of(b)["prompt_n"] == b.usage.prompt_tokens - cached


def test_chat_content_parts_and_refused_roles(chat_server: Served) -> None:
    client = chat_server.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "hello world"}]
    a, b = (client.chat.completions.create(model="chat", messages=m, max_tokens=8, temperature=0)
            for m in (parts, plain))
    assert a.choices[0].message.content == b.choices[0].message.content
    for role in ("robot", ["user"], {"a": 1}):
        r = chat_server.post("/v1/chat/completions", {"messages": [{"role": role, "content": "x"}]}, api_key=None)
        assert_error(r, 400, param="messages[0].role")
    # A tool's answer names the call it answers.
    r = chat_server.post("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, api_key=None)
    assert_error(r, 400, param="messages[0].tool_call_id")
    r = chat_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, api_key=None)
    assert_error(r, 400, param="messages[0].content")


# -- errors -----------------------------------------------------------------------


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
            r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 4}, timeout=30)
            assert r.status_code == 500 and r.json()["error"]["message"] == "the generation failed: decode failed"
            with client.stream("POST", "/v1/chat/completions", timeout=30,
                               json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as s:
                assert s.status_code == 500 and json.loads(s.read())["error"]["code"] == "generation_failed"
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


# -- process -----------------------------------------------------------------------


# Prompts whose greedy answers (48 tokens) have no near-tie that batching could flip (checked below).
CONCURRENT = [("the cat sat on the mat", "ar"), ("once the dog sat", "sps"), ("the house ran", "lookup"),
              ("return a mat", "lookahead"), ("hello house", "auto"), ("ran sat time hello once", "tree"),
              ("to print once house mat", "sps"), ("ran to cat", "ar")]
CONCURRENT_N = 48


def test_the_concurrent_prompts_have_no_near_tie(tiny_engine) -> None:
    """The precondition of the tests below: llama.cpp's batched arithmetic moves a logit by up to
    BATCH_NOISE / 2, so an answer whose greedy choices all win by more than BATCH_NOISE is the same in any
    batch. (A prompt with a closer call may rightly answer otherwise under load: tests/test_batching.py
    prints such divergences with their gaps.)"""
    for prompt, _ in CONCURRENT:
        gap = min_greedy_gap(tiny_engine, tiny_engine.tokenize(prompt), CONCURRENT_N)
        assert gap > BATCH_NOISE, f"{prompt!r}: a greedy choice wins by {gap:.4f} only"


def _answer(client: openai.OpenAI, prompt: str, strategy: str, stream: bool, n: int = CONCURRENT_N) -> str:
    kwargs = dict(model="target", prompt=prompt, max_tokens=n, temperature=0, extra_body=spec(strategy))
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    return client.completions.create(**kwargs).choices[0].text


def test_concurrent_clients_decode_together_and_each_gets_its_text(server: Served) -> None:
    """Eight clients at once on four slots (the default --parallel): four decode together, the others wait
    their turn, and each answer (every strategy, streamed or not) is the one it gets alone."""
    client = server.client()
    alone = [_answer(client, p, s, stream=False) for p, s in CONCURRENT]
    got: list[str | None] = [None] * len(CONCURRENT)

    def ask(i: int) -> None:
        prompt, strategy = CONCURRENT[i]
        got[i] = _answer(server.client(), prompt, strategy, stream=i % 2 == 0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    most = 0
    while any(t.is_alive() for t in threads):
        most = max(most, server.health()["running"])
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert most == 4, f"at most {most} requests decoded at once"
    assert got == alone
    health = server.health()
    assert health["parallel"] == 4 and health["running"] == 0 and health["kv_errors"] == 0


def test_n_choices_decode_together_from_one_prompt_decode(server: Served) -> None:
    """n = 3: three choices in one batch. Greedy, each is the answer alone; sampled with a seed, they differ and
    each is reproducible; the prompt is decoded once (the other choices report it cached); a stream's chunks
    carry each choice's index and assemble to the same texts as the whole answer."""
    client = server.client()
    prompt, strategy = CONCURRENT[0]
    alone = _answer(client, prompt, strategy, stream=False)
    kwargs = dict(model="target", prompt=prompt, max_tokens=CONCURRENT_N, extra_body=spec(strategy))
    greedy = client.completions.create(n=3, temperature=0, **kwargs)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.text for c in greedy.choices] == [alone] * 3
    assert greedy.usage.completion_tokens == 3 * timings_of(greedy)[0]["predicted_n"]
    assert [t["cache_n"] for t in timings_of(greedy)[1:]] == [greedy.usage.prompt_tokens - 1] * 2

    sampled = client.completions.create(n=3, temperature=1.0, seed=7, **kwargs)
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) == 3, texts
    streamed = ["", "", ""]
    finish = [None, None, None]
    for chunk in client.completions.create(n=3, temperature=1.0, seed=7, stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert streamed == texts and finish == [c.finish_reason for c in sampled.choices]
    one = client.completions.create(temperature=1.0, seed=7, **kwargs)
    assert one.choices[0].text == texts[0]  # choice 0 draws with the request's seed, choice k with seed + k

    chat = server.client().chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                                   n=2, max_tokens=8, temperature=1.0, seed=3, stream=True)
    indices = {c.index for chunk in chat for c in chunk.choices}
    assert indices == {0, 1}
    health = server.health()
    assert health["running"] == 0 and health["kv_errors"] == 0


def test_disconnects_and_bad_requests_under_load_leave_every_valid_request_whole(server: Served) -> None:
    """8 clients x 6 requests, each at random a whole answer, a stream, a stream the client drops after two
    chunks, or an invalid request: every valid one completes with its own text, the bad ones get 400, and the
    slots end idle with their caches as their records say (kv_errors counts any that did not)."""
    import random

    client = server.client()
    alone = {(p, s): _answer(client, p, s, stream=False) for p, s in CONCURRENT}
    failures: list[str] = []
    before = server.health()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        c = server.client()
        for _ in range(6):
            prompt, strategy = rng.choice(CONCURRENT)
            kind = rng.choice(["whole", "stream", "drop", "bad"])
            try:
                if kind == "bad":
                    r = server.post("/v1/completions", {"prompt": prompt, "temperature": -1})
                    if r.status_code != 400:
                        failures.append(f"bad request answered {r.status_code}")
                elif kind == "drop":
                    stream = c.completions.create(model="target", prompt=prompt, max_tokens=4000, temperature=0,
                                                  stream=True, extra_body=spec(strategy))
                    it = iter(stream)
                    next(it), next(it)
                    stream.close()
                else:
                    text = _answer(c, prompt, strategy, stream=kind == "stream")
                    if text != alone[(prompt, strategy)]:
                        failures.append(f"{strategy} on {prompt!r}: {text!r} != {alone[(prompt, strategy)]!r}")
            except Exception as e:  # noqa: BLE001 - collected and reported below
                failures.append(f"{kind}: {e!r}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    deadline = time.monotonic() + 30
    while server.health()["running"] and time.monotonic() < deadline:  # dropped streams end within a step
        time.sleep(0.05)
    health = server.health()
    assert health["running"] == 0 and health["queued"] == 0 and health["kv_errors"] == 0
    assert health["cancelled"] > before["cancelled"], "the dropped streams were cancelled"
    slots = httpx.get(f"{server.url}/slots", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    assert len(slots) == 4 and not any(s["is_processing"] for s in slots)
    # No cell leaked: the caches hold exactly what the slots' records keep for the prefix cache (counted by
    # llama.cpp over every sequence id, target and draft), and the target's part is what /slots reports.
    assert health["kv_cells"] == health["kv_cached"] > 0
    assert sum(s["cached_tokens"] for s in slots) <= health["kv_cached"]


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
                        "--port", str(_free_port()), "-t", "1"], capture_output=True, text=True, timeout=300)
    assert "warning: listening on 192.0.2.1" in r.stderr and "without --api-key" in r.stderr
    assert r.returncode == 2 and "cannot serve on 192.0.2.1" in r.stderr


# -- the real demo pair ---------------------------------------------------------------


@pytest.mark.demo
def test_demo_pair_streamed_sps_equals_run(demo_pair, tmp_path: Path) -> None:
    prompt, n = "The capital of France is", 32
    served = start_server(["-m", "demo", "-md", "demo-draft", "-s", "sps"], tmp_path / "server.log", threads="2")
    try:
        chunks = list(served.client().completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0,
                                                         stream=True))
    finally:
        stop_server(served)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    t = timings_of(chunks[-1])
    assert t["strategy"] == "sps" and t["draft_n"] > 0 and t["draft_n_accepted"] > 0
    r = subprocess.run([sys.executable, "-m", "app", "run", prompt, "-m", "demo", "-md", "demo-draft", "-s", "sps",
                        "--temp", "0", "--no-color", "-t", "2", "-n", str(n)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert text and r.stdout == text + "\n"


def test_ignore_eos_gives_max_tokens_and_tokenize_round_trips(server: Served) -> None:
    """llama-server's ignore_eos: the end-of-generation token is never drawn, so every request (every strategy,
    target and drafter masked alike) makes exactly max_tokens; /tokenize and /detokenize are llama-server's."""
    client = server.client()
    kwargs = dict(model="target", prompt="the cat", max_tokens=60, temperature=1.5)
    ends = [seed for seed in range(200) if client.completions.create(seed=seed, **kwargs).usage.completion_tokens < 60]
    assert len(ends) >= 3, "the model ends some of these generations early by itself"
    for strategy in ("ar", "sps", "lookup", "tree", "auto"):
        for seed in ends[:3]:
            r = client.completions.create(seed=seed, extra_body={**spec(strategy), "ignore_eos": True}, **kwargs)
            assert r.usage.completion_tokens == 60 and r.choices[0].finish_reason == "length", strategy
    assert_error(server.post("/v1/completions", {"prompt": "hi", "ignore_eos": "yes"}), 400, param="ignore_eos")
    ids = server.post("/tokenize", {"content": "the cat sat"}).json()["tokens"]
    assert ids and all(isinstance(t, int) for t in ids)
    # (The tiny vocabulary's pieces keep SentencePiece's word marker.)
    assert server.post("/detokenize", {"tokens": ids}).json()["content"].replace("\u2581", " ").strip() == "the cat sat"
    assert_error(server.post("/detokenize", {"tokens": [-1]}), 400, param="tokens")
