"""`specchat serve` as a client sees it: the real server in a subprocess (uvicorn on a free loopback
port), spoken to with the official `openai` client and, for raw HTTP cases, httpx (tests/serve_helpers.py).

Covered here: chat and completions, streamed and not; temperature-0 output equal
to `specchat run`'s; llama-server-shaped `timings`; per-request strategy
switches; KV cache reuse across chat turns; ignore_eos, /tokenize and
/detokenize; the real demo pair. Errors, disconnects and stopping:
tests/test_serve_errors.py; many clients at once: tests/test_serve_load.py;
structured output and tools: tests/test_serve_structured.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from gguf_factory import write_llama_gguf
from serve_helpers import Served, assert_error, spec, start_server, stop_server, timings_of

# A chat template in the style of the GGUFs' (role tags around each message, then the assistant's turn opened).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
PROMPT = "once upon a time"
N = 24


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
    # A client that sends every field, null where unset ("stream": null is OpenAI's default, not a 400).
    nulls = chat_server.post("/v1/chat/completions", {"model": "chat", "messages": messages, "max_tokens": N,
                                                      "temperature": 0, "stream": None, "stream_options": None})
    assert nulls.status_code == 200 and nulls.json()["choices"][0]["message"]["content"] == text, nulls.text


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
