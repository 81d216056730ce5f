"""With temperature 0, `sps` must give the target's own greedy tokens, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from backends.engine import Engine
from backends.config import StrategyOptions
from backends.sampling import GenParams
from backends.strategies.sps import SpsConfig
from engine_helpers import run_to_done

TINY_PROMPTS = ["the cat sat on the mat", "once upon a time there was", "def hello world return print"]
DEMO_PROMPTS = [
    "Once upon a time, in a small village,",
    "The capital of France is",
    "def fibonacci(n):\n",
]
K_VALUES = [1, 2, 4, 8]


def _explain_mismatch(engine: Engine, prompt: list[int], ref: tuple[int, ...], got: tuple[int, ...]) -> str:
    """Where the outputs part, and the target's top-2 logit margin there (a near-tie shows as ~0)."""
    i = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    seq = engine.target
    seq.sync(list(prompt) + list(ref[:i]))
    top2 = np.sort(seq.logits())[-2:]
    return f"first difference at output token {i}: ar {ref[i]} vs {got[i]}; top-2 logit margin {top2[1] - top2[0]:.6f}"


def _check_equal(engine: Engine, text: str, n: int, k: int, adaptive: bool, p_min: float) -> None:
    prompt = engine.tokenize(text)
    params = GenParams(max_tokens=n, temperature=0.0)
    ref = run_to_done(engine, "ar", prompt, params)
    got = run_to_done(engine, "sps", prompt, params, StrategyOptions(sps=SpsConfig(draft_max=k, p_min=p_min, adaptive=adaptive)))
    assert got.stats.drafted > 0
    assert got.tokens == ref.tokens, _explain_mismatch(engine, prompt, ref.tokens, got.tokens)
    assert got.text == ref.text


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("text", TINY_PROMPTS)
def test_sps_equals_ar_tiny(tiny_engine: Engine, text: str, k: int, adaptive: bool) -> None:
    _check_equal(tiny_engine, text, 48, k, adaptive, p_min=0.0)


def test_sps_with_p_min_equals_ar_tiny(tiny_engine: Engine) -> None:
    _check_equal(tiny_engine, TINY_PROMPTS[0], 64, 8, True, p_min=0.3)


@pytest.mark.demo
@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("text", DEMO_PROMPTS)
def test_sps_equals_ar_demo(demo_engine: Engine, text: str, k: int, adaptive: bool) -> None:
    _check_equal(demo_engine, text, 32, k, adaptive, p_min=0.0 if not adaptive else 0.5)


def test_identical_draft_accepts_everything(tiny) -> None:
    from backends.engine import EngineConfig

    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.same_draft, n_ctx=512, threads=1))
    try:
        prompt = engine.tokenize(TINY_PROMPTS[1])
        done = run_to_done(engine, "sps", prompt, GenParams(max_tokens=40),
                           StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0)))
        assert done.stats.acceptance_rate == 1.0
        assert done.stats.mean_accepted_per_forward > 4.0
    finally:
        engine.close()
