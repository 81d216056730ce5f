"""The Qwen3.5 MTP fixture (tests/qwen35_factory.py) as llama.cpp 0.3.36 reads it, so that it cannot rot unseen.

Loads the tiny `qwen35` file with its head (backends.llama), decodes a
prompt and a few greedy tokens through the hybrid trunk (3 gated delta-net
layers, 1 gated attention layer), creates the MTP context and runs the head
by hand as common_speculative_impl_draft_mtp does (rows (x_p, h_{p-1}), the
first paired with zeros): on the exactly-drafting file (residual 0,
head_noise 0) its chain of drafts is the target's own greedy continuation.
Also checks that a context with recurrent-state snapshots (n_rs_seq, what
llama-server sets for --spec-type draft-mtp) rolls a rejected tail back
exactly, and that the engine takes the file's head as its drafter.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from backends.llama import Batch, ContextConfig, LlamaContext, LlamaModel
from backends.llama_ext import HiddenBatch, enable_hidden, hidden_row, hidden_rows
from qwen35_factory import ARCH, Qwen35Model, write_qwen35_mtp_target  # tests/ is on sys.path (conftest.py)

PROMPT = [1, 300, 301, 302, 303, 271]
CONFIG = ContextConfig(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1)


@dataclass(frozen=True)
class Files:
    exact: Path    # residual 0, head_noise 0: the head always agrees
    random: Path   # the default weights: agreement by chance


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    d = tmp_path_factory.mktemp("qwen35")
    return Files(
        exact=write_qwen35_mtp_target(d / "exact.gguf", Qwen35Model(residual=0.0, head_noise=0.0)),
        random=write_qwen35_mtp_target(d / "random.gguf", Qwen35Model(residual=1.0, head_noise=1.0, seed=3)),
    )


def _mtp_context(model: LlamaModel, target: LlamaContext) -> LlamaContext:
    """The model's MTP context beside `target`, whichever spelling backends.llama has (`mtp_of=target`, or
    `other=target, mtp=True` since EAGLE-3 contexts read the target too)."""
    if "mtp_of" in inspect.signature(LlamaContext).parameters:
        return LlamaContext(model, CONFIG, mtp_of=target)
    return LlamaContext(model, CONFIG, other=target, mtp=True)


def _decode(ctx: LlamaContext, tokens: list[int], pos0: int) -> np.ndarray:
    """Decode `tokens` at pos0.. in one batch (every row wants logits); the logits, one row per token."""
    batch = Batch(len(tokens))
    for i, t in enumerate(tokens):
        batch.add(t, pos0 + i, logits=True)
    ctx.decode(batch)
    out = np.stack([ctx.logits(i).copy() for i in range(len(tokens))])
    batch.close()
    return out


def _greedy(ctx: LlamaContext, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation of `prompt` on a fresh sequence, one token per decode; every logit finite."""
    logits = _decode(ctx, prompt, 0)
    assert np.isfinite(logits).all()
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        row = _decode(ctx, [out[-1]], len(prompt) + len(out) - 1)[0]
        assert np.isfinite(row).all()
        out.append(int(row.argmax()))
    return out


def test_the_file_is_a_qwen35_with_one_head(files: Files) -> None:
    from models.gguf_info import validate_gguf

    info = validate_gguf(files.random)
    assert info.architecture == ARCH and info.nextn_layers == 1
    model = LlamaModel(files.random, load_mtp=True)
    try:
        assert model.n_layer_nextn == 1 and model.n_embd == Qwen35Model().n_embd
    finally:
        model.close()


@pytest.mark.parametrize("which", ["exact", "random"])
def test_the_trunk_decodes_and_the_mtp_context_runs(files: Files, which: str) -> None:
    model = LlamaModel(getattr(files, which), load_mtp=True)
    target = LlamaContext(model, CONFIG)
    mtp = _mtp_context(model, target)
    hb = HiddenBatch(mtp)
    try:
        enable_hidden(target, masked=False)
        enable_hidden(mtp, masked=True)
        tokens = _greedy(target, PROMPT, 6)
        assert all(0 <= t < model.n_vocab for t in tokens)
        # The same again on a cleared context: the recurrent state starts afresh.
        target.clear()
        assert _greedy(target, PROMPT, 6) == tokens
        # Prompt plus the first token in one batch: its hidden rows (output-normed, finite) for the head.
        target.clear()
        ctx_tokens = PROMPT + tokens[:1]
        logits = _decode(target, ctx_tokens, 0)
        assert int(logits[-1].argmax()) == tokens[1]
        h = hidden_rows(target, len(ctx_tokens)).copy()
        assert np.isfinite(h).all() and np.allclose(np.sqrt((h * h).mean(axis=1)), 1.0, atol=1e-2)
        # The head: (x_p, h_{p-1}) at p, zeros before the first; logits at the last row.
        pairs = np.vstack([np.zeros((1, model.n_embd), np.float32), h[:-1]])
        rows = [(t, p, [0], p == len(ctx_tokens) - 1) for p, t in enumerate(ctx_tokens)]
        hb.fill(rows, pairs)
        hb.process()
        draft_logits = mtp.logits(len(ctx_tokens) - 1)
        assert np.isfinite(draft_logits).all()
        drafts = [int(draft_logits.argmax())]
        # Deeper: each drafted token with the head's own hidden output, as llama.cpp chains one head.
        for depth in range(3):
            own = hidden_row(mtp, hb.n_rows - 1).copy()
            assert np.isfinite(own).all()
            hb.fill([(drafts[-1], len(ctx_tokens) + depth, [0], True)], own[None, :])
            hb.process()
            row = mtp.logits(0)
            assert np.isfinite(row).all()
            drafts.append(int(row.argmax()))
        if which == "exact":  # the head is wired: its chain is the target's greedy continuation
            assert drafts == tokens[1:5], (drafts, tokens)
    finally:
        hb.close()
        mtp.close()
        target.close()
        model.close()


def test_recurrent_rollback_with_snapshots(files: Files) -> None:
    """With n_rs_seq snapshots (llama-server's --spec-type draft-mtp asks for n_max), a verified chain's rejected
    tail is cut off the recurrent state too: the next decode is what it would have been without the tail."""
    model = LlamaModel(files.random, load_mtp=False)
    ctx = LlamaContext(model, replace(CONFIG, n_rs_seq=4))
    ptr, mem = ctx.ptr, llama_cpp.llama_get_memory(ctx.ptr)
    try:
        assert llama_cpp.llama_n_rs_seq(ptr) == 4
        want = _greedy(ctx, PROMPT, 3)
        ref = _decode(ctx, [want[2]], len(PROMPT) + 2)[0]  # the logits after PROMPT + want[:3], token by token
        want.append(int(ref.argmax()))
        llama_cpp.llama_memory_clear(mem, True)
        _decode(ctx, PROMPT, 0)
        n = len(PROMPT)
        # Verify a chain [t0, d1, d2, d3] of which only d1 is right: keep t0 and d1, drop the rest.
        chain = [want[0], want[1], 5, 7]
        logits = _decode(ctx, chain, n)
        assert int(logits[0].argmax()) == want[1] and int(logits[1].argmax()) == want[2]
        assert llama_cpp.llama_memory_seq_rm(mem, 0, n + 2, -1)
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == n + 1
        row = _decode(ctx, [want[2]], n + 2)[0]
        assert int(row.argmax()) == want[3] and np.allclose(row, ref, atol=1e-3)
        # Without snapshots a partial removal on the recurrent state is refused.
        plain = LlamaContext(model, CONFIG)
        try:
            _decode(plain, PROMPT, 0)
            assert not plain.seq_rm(0, n - 1, -1)
        finally:
            plain.close()
    finally:
        ctx.close()
        model.close()


def test_the_engine_drafts_with_the_head(files: Files) -> None:
    from backends.engine import Engine, EngineConfig
    from backends.sampling import GenParams
    from engine_helpers import run_to_done

    engine = Engine(EngineConfig(target=files.exact, n_ctx=256, threads=1, cost_cache=Path(""), memory=False))
    try:
        assert engine.mtp
        done = run_to_done(engine, "ar", PROMPT, GenParams(max_tokens=12, temperature=0.0))
        assert len(done.tokens) == 12
    finally:
        engine.close()
