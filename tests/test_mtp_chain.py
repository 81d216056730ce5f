"""Chained MTP heads (backends.mtp_chain) against llama.cpp's own `chain_heads` drafting, call for call.

tests/test_mtp.py runs every check of a single head on a file with three
chained heads too (output equal to `ar`'s, cells, labels, the law under
sampling, the server's mixed batches). What is particular to chaining is
checked here, on hy_v3 and step35 files: the drafts are what common/speculative.cpp's
`common_speculative_impl_draft_mtp` drafts (a reference driver below, on
contexts of its own, replays its process() and draft() for one sequence),
which reusing head 0 would not give on this file; and what `models info`
says of such a file, or of one whose architecture runs one head only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from app.cli import main
from backends.engine import Engine, EngineConfig
from backends.llama import Batch, ContextConfig, LlamaContext, LlamaModel
from backends.llama_ext import HiddenBatch, enable_hidden, hidden_row, hidden_rows, set_nextn_layer_offset
from backends.mtp_chain import ChainedMtpSequence
from models.drafters import describe_drafters, mtp_chained, mtp_heads
from models.gguf_info import validate_gguf
from mtp_chain_factory import ARCHITECTURES, ChainModel, write_chained_mtp_target

PROMPTS = ([1, 300, 301, 302, 303], [1, 259 + 4, 259 + 9, 259 + 2], [1, 271, 283, 290, 305, 300, 271])
HEADS = ChainModel().n_heads_mtp


@pytest.fixture(scope="module", params=ARCHITECTURES)
def chained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Heads far from each other and from the target: each drafts its own way."""
    return write_chained_mtp_target(tmp_path_factory.mktemp(f"chain-{request.param}") / "random.gguf",
                                    ChainModel(residual=1.0, head_noise=1.0, seed=3, architecture=request.param))


def reference_chain(path: Path, context: list[int], heads: list[int]) -> list[int]:
    """The greedy drafts after `context` as llama.cpp drafts them with chained heads, draft i by head heads[i]
    (`common_speculative_impl_draft_mtp`, chain_heads): the target decodes the committed tokens (all but the
    last); process() decodes their rows (x_p, h_{p-1}), h_{-1} zeros, once per head after removing the
    sequence's cells; draft() step i removes the cells from pos0 and decodes the whole prefix again under
    heads[i], row t paired with chain_h[t] (the target's h_{pos0-1}, then each step's output)."""
    model = LlamaModel(path, load_mtp=True)
    try:
        config = ContextConfig(n_ctx=256, n_batch=256, n_ubatch=256, n_threads=1)
        target = LlamaContext(model, config)
        mtp = LlamaContext(model, config, other=target, mtp=True)
        enable_hidden(target, masked=False)
        enable_hidden(mtp, masked=True)
        committed, pos0 = context[:-1], len(context) - 1
        batch = Batch(256)
        for p, tok in enumerate(committed):
            batch.add(tok, p, (0,), p == len(committed) - 1)
        target.decode(batch)
        h = hidden_rows(target, len(committed)).copy()
        rows = HiddenBatch(mtp)
        zeros = np.zeros((1, model.n_embd), dtype=np.float32)
        paired = np.concatenate([zeros, h[:-1]]) if len(committed) > 1 else zeros
        for head in range(model.n_layer_nextn):  # process()
            mtp.seq_rm(0, 0, -1)
            set_nextn_layer_offset(mtp, head)
            rows.fill([(tok, p, (0,), False) for p, tok in enumerate(committed)], paired[:len(committed)])
            rows.process()
        tokens, feats, drafts = [context[-1]], [h[-1]], []
        for head in heads:  # draft()
            mtp.seq_rm(0, pos0, -1)
            set_nextn_layer_offset(mtp, head)
            rows.fill([(t, pos0 + i, (0,), i == len(tokens) - 1) for i, t in enumerate(tokens)], np.stack(feats))
            rows.process()
            drafts.append(int(np.argmax(mtp.logits(len(tokens) - 1))))
            tokens.append(drafts[-1])
            feats.append(hidden_row(mtp, len(tokens) - 2).copy())
        set_nextn_layer_offset(mtp, 0)
        for closable in (rows, batch, mtp, target):
            closable.close()
        return drafts
    finally:
        model.close()


def _engine_drafts(engine: Engine, context: list[int], k: int) -> list[int]:
    """What the engine's head drafts greedily after `context`, the target having decoded all but its last."""
    engine.slots[0].reset()
    engine.target.sync(context[:-1], logits=False)
    draft = engine.draft
    draft.sync(context)
    drafts = [int(np.argmax(draft.logits()))]
    for _ in range(k - 1):
        draft.extend([drafts[-1]])
        drafts.append(int(np.argmax(draft.logits())))
    return drafts


def test_the_chain_drafts_what_llama_cpp_drafts(chained: Path) -> None:
    """Draft k comes from head k with the whole chain decoded again, as llama.cpp's driver does; on this file
    reusing head 0 for every draft proposes other tokens (so a driver that did would fail here)."""
    engine = Engine(EngineConfig(target=chained, n_ctx=256, threads=1, cost_cache=Path(""), memory=False))
    try:
        assert isinstance(engine.draft, ChainedMtpSequence) and engine.draft.depth_max == HEADS
        differs = 0
        for prompt in PROMPTS:
            context = list(prompt) + [300, 305, 271]
            want = reference_chain(chained, context, list(range(HEADS)))
            assert _engine_drafts(engine, context, HEADS) == want, prompt
            differs += reference_chain(chained, context, [0] * HEADS) != want
            with pytest.raises(ValueError, match="at most 3 tokens"):  # no head past the last
                engine.draft.extend([want[-1]])
        assert differs > 0, "the heads of this file draft alike: the check above would not tell them apart"
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_generation_drafts_and_accepts_what_llama_servers_loop_does(arch: str, tmp_path: Path) -> None:
    """Whole greedy generations, counted as llama-server's `timings` count them: specchat's `sps` (K 3, p_min
    0, K fixed) drafts and accepts, prompt for prompt, exactly what llama-server's draft-mtp loop replayed on
    the same build does (tests/llama_server_mtp.py) once that loop also drafts for the first output token, as
    sps does and llama-server does not (it samples that token from the prompt's logits), and ends a chain at the
    end of generation, as specchat's drafting loop does and llama-server's does not; with llama-server's
    own schedule the tokens are the same and the steps fall elsewhere (docs/mtp-chain.md). The file is the
    chained fixture tests/perf/drafter_fixtures.py writes, whose heads agree with the target often enough
    that accepting (and so pending_h = the target's row n) runs."""
    from backends.config import StrategyOptions
    from backends.sampling import GenParams
    from backends.strategies.sps import SpsConfig
    from engine_helpers import run_to_done
    from llama_server_mtp import ChainedMtpServer

    path = write_chained_mtp_target(tmp_path / f"{arch}.gguf", ChainModel(architecture=arch))
    options = StrategyOptions(sps=SpsConfig(draft_max=3, p_min=0.0, adaptive=False))
    engine = Engine(EngineConfig(target=path, n_ctx=512, threads=1, cost_cache=Path(""), memory=False))
    server = ChainedMtpServer(path, k=3, n_ctx=512)
    try:
        ours, replayed, schedule = [], [], []
        for prompt in PROMPTS:
            done = run_to_done(engine, "sps", list(prompt), GenParams(max_tokens=32, temperature=0.0), options)
            ours.append((list(done.tokens), done.stats.drafted, done.stats.accepted))
            same = server.generate(list(prompt), 32, draft_first=True, stop_at_eos=True)
            replayed.append((same.tokens, same.drafted, same.accepted))
            schedule.append(server.generate(list(prompt), 32))
        assert ours == replayed
        assert all(g.tokens == t for g, (t, _, _) in zip(schedule, ours))
        assert sum(a for _, _, a in ours) > 10, "drafts were accepted: the accepting path ran"
    finally:
        server.close()
        engine.close()


def test_models_info_says_the_heads_chain(chained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["models", "info", str(chained), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["mtp_heads"] == HEADS
    assert data["drafters"].startswith(f"MTP heads: {HEADS}, chained (draft k by head k, up to {HEADS} drafts")


def test_several_heads_of_a_one_head_architecture_are_not_drafted_with(chained: Path) -> None:
    """llama.cpp's MTP graph of qwen35 (and every architecture but step35, mimo2, hy_v3) asserts one block: a
    file of theirs with several would abort the process, so it is said and not drafted with."""
    info = validate_gguf(chained)
    assert mtp_heads(info) == HEADS and mtp_chained(info)
    for arch, heads in (("step35", HEADS), ("mimo2", HEADS), ("qwen35", 0), ("glm4moe", 0)):
        other = dataclasses.replace(info, architecture=arch)
        assert mtp_heads(other) == heads and mtp_chained(other) == bool(heads), arch
        if not heads:
            assert "takes a single head" in describe_drafters(other)
    one = dataclasses.replace(info, architecture="qwen35", nextn_layers=1)
    assert mtp_heads(one) == 1 and not mtp_chained(one)
    assert mtp_heads(dataclasses.replace(info, architecture="glm5-next", nextn_layers=1)) == 0  # graph throws
