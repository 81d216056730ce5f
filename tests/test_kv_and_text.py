"""The KV cache after speculation is what a fresh context would hold; text is released whole."""

from __future__ import annotations

import numpy as np
import pytest

from backends.engine import Engine
from backends.config import StrategyOptions
from backends.kv import KvSequence, common_prefix
from backends.llama import ContextConfig, LlamaContext
from backends.sampling import GenParams
from backends.strategies.sps import SpsConfig
from backends.text import TextStream
from engine_helpers import run_to_done


def _next_logits_from_cache(engine: Engine, done_tokens: tuple[int, ...], prompt: list[int]) -> np.ndarray:
    """Logits after prompt+output, computed on the cache the generation left behind.

    The cache holds the context minus its last token (or all of it after an
    end-of-generation token, which is not part of the output); `sync` decodes
    only the last token on top of the cached cells.
    """
    context = prompt + list(done_tokens)
    assert engine.target.tokens in (context, context[:-1])
    assert engine.target.sync(context) == len(context) - 1
    return engine.target.logits().copy()


def _fresh_logits(engine: Engine, context: list[int]) -> np.ndarray:
    ctx = LlamaContext(engine.target_model, ContextConfig(n_ctx=engine.target.n_ctx, n_threads=1))
    try:
        seq = KvSequence(ctx)
        seq.sync(context)
        return seq.logits().copy()
    finally:
        ctx.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_cache_after_sps_matches_fresh_context(tiny_engine: Engine, temperature: float) -> None:
    prompt = tiny_engine.tokenize("the big red dog ran to the house")
    params = GenParams(max_tokens=60, temperature=temperature, seed=3)
    done = run_to_done(tiny_engine, "sps", prompt, params, StrategyOptions(sps=SpsConfig(draft_max=6, p_min=0.0)))
    assert done.stats.accepted > 0 and done.stats.accepted < done.stats.drafted  # rollbacks happened
    cached = _next_logits_from_cache(tiny_engine, done.tokens, prompt)
    fresh = _fresh_logits(tiny_engine, prompt + list(done.tokens))
    # A batch of k tokens and k single-token decodes sum in different orders:
    # ~0.01 apart on logits of magnitude ~15. A stale or missing cell moves them by O(1).
    assert int(np.argmax(cached)) == int(np.argmax(fresh))
    np.testing.assert_allclose(cached, fresh, atol=0.05, rtol=0)
    # The draft's cache is consistent too: it holds a prefix of the committed text.
    assert tiny_engine.draft.tokens == (prompt + list(done.tokens))[: len(tiny_engine.draft.tokens)]


@pytest.mark.demo
def test_cache_after_sps_matches_fresh_context_demo(demo_engine: Engine) -> None:
    prompt = demo_engine.tokenize("The quick brown fox")
    done = run_to_done(demo_engine, "sps", prompt, GenParams(max_tokens=40),
                       StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0)))
    assert done.stats.accepted < done.stats.drafted
    cached = _next_logits_from_cache(demo_engine, done.tokens, prompt)
    fresh = _fresh_logits(demo_engine, prompt + list(done.tokens))
    assert int(np.argmax(cached)) == int(np.argmax(fresh))
    np.testing.assert_allclose(cached, fresh, atol=2e-2 * float(np.abs(fresh).max()), rtol=0)


def test_second_turn_reuses_the_cache(tiny_engine: Engine) -> None:
    prompt = tiny_engine.tokenize("the cat sat on the mat")
    first = run_to_done(tiny_engine, "sps", prompt, GenParams(max_tokens=20))
    follow = prompt + list(first.tokens) + tiny_engine.tokenize("and the dog")[1:]
    second = run_to_done(tiny_engine, "ar", follow, GenParams(max_tokens=10))
    assert second.stats.prompt_cached == len(prompt) + len(first.tokens) - 1


def _pieces(mapping: dict[int, bytes]):
    return mapping.__getitem__


def test_utf8_character_split_across_tokens_is_released_whole() -> None:
    euro = "€".encode()  # three bytes
    stream = TextStream(_pieces({1: b"a", 2: euro[:1], 3: euro[1:2], 4: euro[2:], 5: b"b"}))
    assert [stream.push(t) for t in (1, 2, 3, 4, 5)] == ["a", "", "", "€", "b"]


def test_stop_string_is_held_back_then_cut() -> None:
    stream = TextStream(_pieces({1: b"hello ", 2: b"wor", 3: b"ld", 4: b"!"}), stop=("world",))
    assert stream.push(1) == "hello "
    assert stream.push(2) == ""  # might be the start of "world"
    assert stream.push(3) == "" and stream.stopped
    assert stream.text == "hello "


def test_held_text_released_when_stop_does_not_come() -> None:
    stream = TextStream(_pieces({1: b"wo", 2: b"rm"}), stop=("world",))
    assert stream.push(1) == ""
    assert stream.push(2) == "worm"
    stream2 = TextStream(_pieces({1: b"wo"}), stop=("world",))
    stream2.push(1)
    assert stream2.flush() == "wo" and stream2.text == "wo"


def test_real_model_text_matches_llama_detokenizer(tiny_engine: Engine) -> None:
    prompt = tiny_engine.tokenize("hello world, the cat is red!")
    done = run_to_done(tiny_engine, "ar", prompt, GenParams(max_tokens=50, temperature=1.0, seed=11))
    assert tiny_engine.target_model.detokenize(done.tokens) == done.text


@pytest.mark.demo
def test_rollback_refused_on_a_sliding_window_cache_past_its_window(demo_pair) -> None:
    """Gemma 3 uses a sliding window: without swa_full, cutting back past the window must be refused."""
    from backends.kv import CacheRollbackError
    from backends.llama import LlamaModel

    model = LlamaModel(demo_pair.draft)
    tokens = model.tokenize("hello world, this is a long text. " * 300, True, True)[:2500]
    for swa_full in (False, True):
        ctx = LlamaContext(model, ContextConfig(n_ctx=4096, n_ubatch=64, swa_full=swa_full, n_threads=2))
        seq = KvSequence(ctx)
        seq.sync(tokens, logits=False)
        try:
            if swa_full:
                seq.truncate(100)
                assert ctx.pos_max(0) == 99 and len(seq.tokens) == 100
            else:
                with pytest.raises(CacheRollbackError, match="cannot remove part"):
                    seq.truncate(100)
                assert seq.tokens == []  # nothing half-kept: the next sync starts clean
        finally:
            ctx.close()


def test_common_prefix_agrees_with_counting_token_by_token() -> None:
    """Halving with list comparisons finds what a token-by-token count finds: every place of the first
    difference, none, one sequence a prefix of the other, and a list against a tuple."""
    rng = np.random.default_rng(7)

    def counted(a: list[int], b: list[int]) -> int:
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    base = [int(t) for t in rng.integers(0, 5, 300)]
    for n in (0, 1, 2, 3, 17, 128, 299, 300):
        other = base[:n] + [9] + base[n + 1:]
        assert common_prefix(base, other) == counted(base, other) == min(n, 300)
        assert common_prefix(base[:n], base) == n and common_prefix(base, tuple(base[:n])) == n
    for _ in range(200):
        a, b = ([int(t) for t in rng.integers(0, 2, int(rng.integers(0, 40)))] for _ in range(2))
        assert common_prefix(a, b) == counted(a, b), (a, b)
