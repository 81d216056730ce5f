"""Lookahead decoding and prompt lookup: greedy equality with `ar`, losslessness, the n-gram pool, parity with llama.cpp."""

from __future__ import annotations

import pytest

from app.bench.prompts import BUILTIN
from backends.config import StrategyOptions
from backends.engine import Engine
from backends.events import Token
from backends.sampling import GenParams
from backends.strategies.lookahead import LookaheadConfig
from backends.strategies.lookup import LookupConfig, NgramIndex
from backends.strategies.ngram_pool import NgramPool
from engine_helpers import run_to_done
from test_greedy_equality import DEMO_PROMPTS, TINY_PROMPTS, _explain_mismatch

WNG = [(15, 5, 15), (4, 3, 4), (8, 4, 8), (5, 2, 0), (1, 2, 1)]


def _equal_to_ar(engine: Engine, text: str, n: int, options: StrategyOptions, strategy: str):
    prompt = engine.tokenize(text)
    params = GenParams(max_tokens=n)
    ref = run_to_done(engine, "ar", prompt, params)
    got = run_to_done(engine, strategy, prompt, params, options)
    assert got.tokens == ref.tokens, _explain_mismatch(engine, prompt, ref.tokens, got.tokens)
    return got


@pytest.mark.parametrize("wng", WNG, ids=lambda t: "W{}N{}G{}".format(*t))
@pytest.mark.parametrize("text", TINY_PROMPTS)
def test_lookahead_equals_ar_tiny(tiny_engine: Engine, text: str, wng: tuple[int, int, int]) -> None:
    _equal_to_ar(tiny_engine, text, 64, StrategyOptions(lookahead=LookaheadConfig(*wng)), "lookahead")


@pytest.mark.parametrize("wng", [(2, 3, 2), (1, 3, 1)], ids=lambda t: "W{}N{}G{}".format(*t))
@pytest.mark.parametrize("prompt", BUILTIN, ids=lambda p: p.category)
def test_lookahead_equals_ar_on_builtin_prompts(tiny_engine: Engine, prompt, wng) -> None:
    """Regression: the pool changes while a step verifies its n-grams; the step must use its own copy."""
    _equal_to_ar(tiny_engine, prompt.text, 64, StrategyOptions(lookahead=LookaheadConfig(*wng)), "lookahead")


def test_lookahead_accepts_on_repetitive_text(tiny_engine: Engine) -> None:
    """The tiny model falls into loops: the pool must catch them and accept n-grams."""
    done = _equal_to_ar(tiny_engine, TINY_PROMPTS[0], 160, StrategyOptions(lookahead=LookaheadConfig(8, 4, 8)),
                        "lookahead")
    assert done.stats.accepted > 0
    assert done.stats.target_forwards < done.stats.generated_tokens
    assert done.stats.extra["ngram_pool_size"] > 0


@pytest.mark.parametrize("ngram_max", [1, 2, 4])
@pytest.mark.parametrize("text", TINY_PROMPTS)
def test_lookup_equals_ar_tiny(tiny_engine: Engine, text: str, ngram_max: int) -> None:
    _equal_to_ar(tiny_engine, text, 64, StrategyOptions(lookup=LookupConfig(draft_max=6, ngram_max=ngram_max)), "lookup")


def test_lookup_copies_repeated_input(tiny_engine: Engine) -> None:
    done = _equal_to_ar(tiny_engine, TINY_PROMPTS[0], 160, StrategyOptions(lookup=LookupConfig()), "lookup")
    assert done.stats.accepted > 0 and done.stats.mean_accepted_per_forward > 1.0


@pytest.mark.demo
@pytest.mark.parametrize("wng", WNG, ids=lambda t: "W{}N{}G{}".format(*t))
@pytest.mark.parametrize("text", DEMO_PROMPTS[:2])
def test_lookahead_equals_ar_demo(demo_engine: Engine, text: str, wng: tuple[int, int, int]) -> None:
    _equal_to_ar(demo_engine, text, 32, StrategyOptions(lookahead=LookaheadConfig(*wng)), "lookahead")


@pytest.mark.demo
@pytest.mark.parametrize("ngram_max", [2, 4])
def test_lookup_equals_ar_demo(demo_engine: Engine, ngram_max: int) -> None:
    text = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.\nRepeat:"
    _equal_to_ar(demo_engine, text, 32, StrategyOptions(lookup=LookupConfig(ngram_max=ngram_max)), "lookup")


# Recorded from llama.cpp's reference program (examples/lookahead at the tag llama-cpp-python 0.3.36 vendors,
# built in Release; W=15, N=5, G=15 are compiled into it) on the demo target:
#   llama-lookahead -m gemma-3-270m-F32.gguf -p "Once upon a time, in a small village," -n 128 -t 2 --temp 0 -c 4096
# It printed n_predict = 129 (plus the first token: 130 tokens) and n_accept = 53 (on an AMD EPYC with AVX2, and
# before on the machine the figure was first recorded on).
# specchat gave 42-43 here while its prefill decoded the whole prompt in one batch; lookahead.cpp decodes all but
# the last token, then the last one alone, and the window's guesses (argmaxes over near-ties) follow the rounding
# of that cell. Laid out batch for batch as lookahead.cpp does, it accepts 53 on this machine, the reference's
# count. Another CPU's kernels may round some near-ties otherwise (both programs' counts move then), so the test
# asks for the recorded count within a quarter.
LOOKAHEAD_CPP_TOKENS = 130
LOOKAHEAD_CPP_N_ACCEPT = 53


@pytest.mark.demo
def test_lookahead_matches_llama_cpp_n_accept(demo_engine: Engine) -> None:
    prompt = demo_engine.tokenize("Once upon a time, in a small village,")
    events = list(demo_engine.strategy("lookahead", StrategyOptions(lookahead=LookaheadConfig(15, 5, 15)))
                  .generate(prompt, GenParams(max_tokens=LOOKAHEAD_CPP_TOKENS)))
    kinds = [e.kind for e in events if isinstance(e, Token) and e.kind != "rejected"]
    assert len(kinds) == LOOKAHEAD_CPP_TOKENS
    # lookahead.cpp counts a match when it samples the token after it, so a match
    # on the very last token is not in its n_accept; compare the same tokens.
    n_accept = kinds[:-1].count("accepted")
    assert 0.75 * LOOKAHEAD_CPP_N_ACCEPT <= n_accept <= 1.25 * LOOKAHEAD_CPP_N_ACCEPT, n_accept


def test_ngram_pool_is_a_ring_without_duplicates() -> None:
    pool = NgramPool(2)
    assert pool.add(7, (1, 2)) and not pool.add(7, (1, 2))
    assert pool.add(7, (3, 4)) and pool.get(7) == ((1, 2), (3, 4))
    assert pool.add(7, (5, 6)) and pool.get(7) == ((5, 6), (3, 4))  # oldest slot overwritten
    assert pool.get(8) == () and len(pool) == 2
    assert not NgramPool(0).add(1, (2,))


def test_ngram_index_finds_latest_earlier_occurrence() -> None:
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]
    assert index.propose(tokens, 3) == [9, 1, 5]  # "5 6" last seen at 4, followed by 9 1 5
    assert index.propose(tokens + [42], 2) == []  # 42 never seen before
    assert index.propose([1, 2, 3], 2) == []
