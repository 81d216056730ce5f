"""A DFlash or DSpark block draft (`-md` of architecture `dflash`) as a drafter: one decode, a whole chain.

llama.cpp's `common_speculative_impl_draft_dflash` (common/speculative.cpp
:922-1329 in the version vendored in llama-cpp-python 0.3.36; read in
docs/dflash-protocol.md) keeps, for every committed position p, the draft's
keys and values computed from the target's layer inputs at p ("injection":
embedding rows decoded into the draft's cells, after every target decode),
and drafts with one decode of the block `[last token, <mask> x k]` right
after them, attending non-causally: the mask rows' logits are the k drafts,
the i-th row's the token i places after the last one. Block Diffusion drafting
(Chen et al. 2025, "DFlash: Block Diffusion for Flash Speculative Decoding");
DSpark adds a Markov head that biases each row by the previous row's in-graph
argmax and reads its drafts from the anchor's row on.

Here the draft is a `KvSequence` (`DFlashSequence`) whose cells are the
injected ones, cell p <-> token p (so truncate, copy_prefix, save and restore
are KvSequence's: injected cells need nothing but themselves), on a lane of
its own (`DFlashLane`). Everything that drafts a chain on a sequence (sps,
`auto`'s chains, tree, the scheduler's draft lane) runs it: `syncing(context)`
injects what the draft lacks and decodes the block on the context's last
token; the chain's logits are the block's rows, and `extending([d])` decodes
nothing, it moves to the next row (a block drafter's drafts do not depend on
the tokens drafted before them: each row's distribution is fixed by the
context, so a draw from row i is a proper proposal q_i for rejection sampling
whatever was drawn before). `chain_max` caps a chain at the block, and
`plan(k)` asks for a block of k drafts, as llama-server sizes it from
`--spec-draft-n-max`.
What differs from llama.cpp and why:
  - When. The target's lane hands each slot's rows of the layer inputs to its
    stash after every decode (backends.eagle3's LayerFeed, as llama.cpp's
    process() reads them at the same moment), and they are injected lazily,
    at the draft's next syncing, in one batch with its block: `ar`, or `auto`
    not drafting, pays nothing for the draft (as the MTP head and EAGLE-3 do
    here, backends.mtp). A row whose features are gone (cells restored from
    a cache, the same prompt again) is injected as zeros: drafts degrade,
    never the output.
  - The block's cells. llama-server removes them after drafting
    (seq_rm(pos_max + 1), tools/server/server-context.cpp:3036-3047); here at
    once, in the same syncing: under non-causal attention any cell of the
    sequence is seen by the next block, so none may outlive its decode.
  - One lane decode, several llama.cpp decodes. An injection row is an
    embedding, a block row a token: a llama_batch_ext takes one kind (its
    first row fixes its width), and llama.cpp aborts on a non-causal decode
    longer than n_ubatch (src/llama-context.cpp:1787). So `DFlashLane.decode`
    decodes the injection rows of all requests first, in chunks of n_ubatch,
    then the blocks, whole blocks per decode and blocks of one length together
    (DSpark's Markov head asserts it, src/models/dflash.cpp:322), every row asking for
    logits (the dflash graph selects no outputs, so llama.cpp's outputs are
    the first rows of the batch) and copies their logits: the rows it
    returns index that copy, which the sequence keeps until its next block.
  - The drafts. llama.cpp takes each row's argmax through a top-k 10
    sampler and stops at p_min; here each row is read as a draft model's
    logits are (backends.strategies.drafting: greedy argmax, or a draw from
    the tempered distribution kept as q), so the drafts are llama.cpp's at
    temperature 0 and sampling stays lossless. DSpark's confidence head is not
    read (sps's p_min reads the top probability, as for every drafter).
  - DFlash2 (a selector lattice walked greedily, no distribution) is refused
    in one line (models.drafters.dflash_problems), as are targets whose graph
    gives no layer inputs (llama.cpp aborts on them) and drafts whose hidden
    size or layers do not fit the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from backends.eagle3 import LAYER_INPUT_TARGETS, LOGIT_FLOOR, LayerFeed
from backends.errors import ContextFullError
from backends.kv import KvSequence, Lane, common_prefix
from backends.llama import ContextConfig, LlamaContext, LlamaModel
from backends.llama_ext import (InjectBatch, TokenBatch, dflash_selector_top_k, enable_layer_inputs, mask_token,
                                n_layer, n_ubatch, set_causal_attention, target_layer_ids)
from backends.mtp import KEEP_BEHIND, HiddenStash
from backends.steps import Decode, Entry, Rows
from models.errors import incompatible_pair


@dataclass(frozen=True)
class BlockSpec:
    """How a DFlash file drafts, as common/speculative.cpp:980-1023 reads it: its trained block, its mask token,
    whether its drafts start at the anchor's row (DSpark's anchor-first layout) and whether its block attends
    causally (`dflash.attention.causal`)."""

    block_size: int
    mask: int
    anchor_first: bool = False
    causal: bool = False

    def __post_init__(self) -> None:
        if self.block_size < (1 if self.anchor_first else 2):
            raise ValueError(f"a block of {self.block_size} holds no draft")
        if self.mask < 0:
            raise ValueError("a DFlash draft needs a mask token")

    @property
    def max_drafts(self) -> int:
        """The most drafts one block gives (llama.cpp clamps --spec-draft-n-max to it)."""
        return self.block_size if self.anchor_first else self.block_size - 1

    @property
    def first(self) -> int:
        """The block row of the first draft."""
        return 0 if self.anchor_first else 1

    def rows(self, k: int) -> int:
        """The block's rows for k drafts."""
        return k if self.anchor_first else k + 1


class DFlashLane(Lane):
    """The draft's context. Entries are injection rows (token, position, sequence ids, False, features) and block
    rows (token, position, sequence ids, True); `out` holds the logits of the last decode's block rows, indexed
    by the rows `decode` returned for them."""

    def __init__(self, ctx: LlamaContext, width: int, ids_per_token: int | None = None,
                 chunk: int | None = None, reserve: int = 0) -> None:
        super().__init__(ctx, ids_per_token, chunk)
        self.ubatch = min(n_ubatch(ctx), ctx.n_batch)
        # A non-causal decode must fit one ubatch; a request's injection leaves room for its block (`reserve`
        # rows) in the scheduler's batch.
        self.chunk = max(1, min(self.chunk, self.ubatch, self.capacity - reserve))
        self.injection = InjectBatch(ctx, width)
        self.blocks = TokenBatch(ctx)
        self.out = np.zeros((0, ctx.n_vocab), dtype=np.float32)
        self.injected = 0  # rows injected so far
        self.decodes = 0  # llama.cpp decodes so far (a lane decode may take several)

    def decode(self, requests: Sequence[Sequence[Entry]]) -> list[list[int]]:
        rows = [[0] * len(entries) for entries in requests]
        inject = [(r, i) for r, entries in enumerate(requests) for i, e in enumerate(entries) if len(e) > 4]
        seconds = 0.0
        for start in range(0, len(inject), self.ubatch):
            part = inject[start:start + self.ubatch]
            seconds += self.injection.process([(requests[r][i][1], requests[r][i][2][0]) for r, i in part],
                                              np.stack([requests[r][i][4] for r, i in part]))
            self.decodes += 1
            for j, (r, i) in enumerate(part):
                rows[r][i] = j
        self.injected += len(inject)
        # Whole blocks per decode, blocks of one length together (DSpark's Markov head asserts every block of a
        # ubatch is as long: src/models/dflash.cpp:322); their logits copied, one row per block row.
        passes: list[tuple[int, list[tuple[int, int]]]] = []  # (block length, its rows)
        for r, entries in enumerate(requests):
            block = [(r, i) for i, e in enumerate(entries) if len(e) <= 4]
            if not block:
                continue
            fit = next((part for n, part in passes if n == len(block) and len(part) + n <= self.ubatch), None)
            if fit is None:
                passes.append((len(block), block))
            else:
                fit += block
        outs, at = [], 0
        for _, part in passes:
            logits, t = self.blocks.process([(requests[r][i][0], requests[r][i][1], requests[r][i][2][0])
                                             for r, i in part])
            seconds += t
            self.decodes += 1
            outs.append(logits)
            for j, (r, i) in enumerate(part):
                rows[r][i] = at + j
            at += len(part)
        if outs:
            self.out = outs[0] if len(outs) == 1 else np.concatenate(outs)
            np.maximum(self.out, LOGIT_FLOOR, out=self.out)  # a d2t draft's -inf outside its vocabulary
        self.last_rows = n = sum(map(len, requests))
        if n and not inject:
            self.live.observe(n, seconds)
        return rows

    def close(self) -> None:
        self.injection.close()
        self.blocks.close()


class DFlashSequence(KvSequence):
    """One slot's share of the draft's context: cell p holds the target's features at token p; a block decoded on
    the context's last token gives the chain's logits, row by row."""

    label = "dflash"

    def __init__(self, lane: DFlashLane, stash: HiddenStash, spec: BlockSpec, base: int = 0,
                 n_ids: int | None = None, n_ctx: int | None = None) -> None:
        super().__init__(lane, base, n_ids, n_ctx)
        self.stash = stash
        self.spec = spec
        self.k = spec.max_drafts  # drafts the next block holds (plan)
        self.missing = 0  # rows injected as zeros for want of the target's features
        self.blocks = 0  # block decodes so far
        self._block: np.ndarray | None = None  # the last block's logits, from its first draft's row
        self._anchor = -1  # the last block's first position (its anchor token's)

    @property
    def chain_max(self) -> int:  # type: ignore[override]
        return self.spec.max_drafts

    def plan(self, k: int) -> None:
        self.k = max(1, min(k, self.spec.max_drafts))

    def _inject(self, tokens: Sequence[int], start: int, stop: int) -> list[tuple]:
        out = []
        for p in range(start, stop):
            f = self.stash.get(p, tokens[p])
            if f is None:
                f = self.stash.zeros()
                self.missing += 1
            out.append((tokens[p], p, (self.base,), False, f))
        return out

    def _block_rows(self, last: int, pos: int) -> list[tuple]:
        n = self.spec.rows(self.k)
        return [(last if i == 0 else self.spec.mask, pos + i, (self.base,), True) for i in range(n)]

    def syncing(self, tokens: Sequence[int], logits: bool = True):
        """Inject the target's features of `tokens` (of all but the last with logits=True, whose block is then
        decoded at its position; without, only as far as the target's features are at hand: a prompt the target
        has not decoded yet is injected at the next syncing). Returns how many cells were kept."""
        self._block = None
        n = len(tokens)
        if logits and n == 0:
            raise ValueError("a block needs a last token")
        stop = n - 1 if logits else n
        keep = min(common_prefix(self.tokens, tokens), stop)
        self.truncate(keep)
        # Cells past the record (a block whose machine was closed before it could drop them, a chunk whose decode
        # failed) go too: under non-causal attention the next block would see them.
        self.ctx.seq_rm(self.base, len(self.tokens), -1)
        if not logits:
            stop = keep
            while stop < n and self.stash.get(stop, tokens[stop]) is not None:
                stop += 1
        need = stop + (self.spec.rows(self.k) if logits else 0)
        if need > self.n_ctx:
            raise ContextFullError(f"{need} tokens do not fit in the context of {self.n_ctx}")
        rows: list[int] = []
        block = self._block_rows(tokens[-1], stop) if logits else []
        for start in range(keep, stop, self.lane.chunk):
            end = min(stop, start + self.lane.chunk)
            entries = self._inject(tokens, start, end) + (block if end == stop else [])
            rows = yield Decode(self.lane, entries)
            self.tokens.extend(tokens[start:end])
        if block and keep == stop:
            rows = yield Decode(self.lane, block)
        self.stash.drop_below(len(self.tokens) - KEEP_BEHIND)
        if block:
            # Its cells go now: the next block (non-causal) would attend to them.
            self.ctx.seq_rm(self.base, stop, -1)
            at = rows[-len(block):][self.spec.first:]
            self._block = self.lane.out[np.asarray(at, dtype=np.intp)]
            self._anchor = stop
            self.rows, self.last_row = list(range(len(self._block))), 0
            self.blocks += 1
        return keep

    def extending(self, tokens: Sequence[int], logits: str = "last") -> Rows:
        """Drafted `tokens` after the block's last read row: no decode, the next rows. Without a block at hand
        (after a prefill), a block on the last of them, the others injected without the target's features."""
        if not tokens:
            return []
        if self._block is None:
            yield from self.syncing(list(self.tokens) + list(tokens))
            return self.rows
        depth = self.last_row + len(tokens)
        self.rows, self.last_row = list(range(self.last_row + 1, depth + 1)), depth
        return self.rows

    def decoding(self, entries: Iterable[tuple[int, int, Iterable[int], bool]]) -> Rows:
        """A tree's nodes: no decode; a node at position p is followed by the block's row for p + 1 (every node
        of a depth shares it: the block's rows depend on the context alone)."""
        rows = [pos - self._anchor for _, pos, _, _ in entries]
        return rows
        yield  # a coroutine that decodes nothing

    def logits(self, row: int | None = None) -> np.ndarray:
        """The block's logits of the draft after `row` drafted tokens (a copy: a tree reads a row for several
        nodes, each masked for its own path); flat past the block (uniform: drafts are wasted, never wrong)."""
        j = self.last_row if row is None else row
        if self._block is None or not 0 <= j < len(self._block):
            return np.zeros(self.n_vocab, dtype=np.float32)
        return self._block[j].copy()

    # A tree's scratch sequences hold nothing of a block drafter's: there is nothing to copy or drop.
    def fork(self, src: int, dst: int) -> None:
        pass

    def drop_seq(self, seq: int) -> None:
        pass

    def truncate(self, n: int) -> None:
        self._block = None
        super().truncate(n)

    def reset(self) -> None:
        super().reset()
        self._block = None
        self.stash.clear()


def check_dflash(target: LlamaModel, draft: LlamaModel) -> tuple[tuple[int, ...], BlockSpec]:
    """The target layers `draft` reads and how it drafts, as llama.cpp loaded it; a ModelError line when it does
    not fit `target` (llama.cpp would abort or fail: docs/dflash-protocol.md)."""
    layers, top = target_layer_ids(draft), n_layer(target)
    arch = target.info.architecture
    info = draft.info
    problems = []
    if arch not in LAYER_INPUT_TARGETS:
        problems.append(f"llama.cpp 0.3.36 gives no layer inputs of a {arch} target")
    if not layers:
        problems.append("it names no target layers")
    too_deep = [i for i in layers if not 0 <= i < top]
    if too_deep:
        problems.append(f"it reads layers {too_deep}, the target has {top}")
    if draft.n_embd != target.n_embd:
        problems.append(f"its hidden size is {draft.n_embd}, the target's {target.n_embd}")
    if draft.n_vocab != target.n_vocab:
        problems.append(f"its vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}")
    mask = mask_token(draft)
    if not 0 <= mask < draft.n_vocab:
        problems.append("it names no mask token (tokenizer.ggml.mask_token_id)")
    if dflash_selector_top_k(draft) > 0:
        problems.append("it is a DFlash2 draft (a selector lattice), which specchat does not run")
    if problems:
        raise incompatible_pair(target.path.name, draft.path.name, problems)
    spec = BlockSpec(int(getattr(info, "dflash_block", 16)), mask, bool(getattr(info, "dflash_anchor_first", False)),
                     causal=bool(getattr(info, "dflash_causal", False)))
    return layers, spec


def dflash_lanes(target: Lane, draft: LlamaModel, config: ContextConfig, ids: int, chunk: int | None,
                 n_slots: int, n_ctx: int) -> tuple[DFlashLane, list[DFlashSequence]]:
    """The draft's context beside the target's (ctx_other, as common/speculative.cpp:2529-2535 makes it), its
    lane, and one DFlashSequence per slot, fed with the target lane's layer inputs from now on."""
    layers, spec = check_dflash(target.ctx.model, draft)
    ctx = LlamaContext(draft, config, other=target.ctx)
    try:
        enable_layer_inputs(target.ctx, layers)
        set_causal_attention(ctx, spec.causal)  # common/speculative.cpp:1063
        width = len(layers) * target.ctx.model.n_embd
        lane = DFlashLane(ctx, width, ids, chunk, reserve=spec.rows(spec.max_drafts))
    except BaseException:
        ctx.close()
        raise
    stashes = [HiddenStash(i * ids, ids, width, cap=max(256, n_ctx)) for i in range(n_slots)]
    target.followers.append(LayerFeed(target.ctx, layers, stashes))
    return lane, [DFlashSequence(lane, stashes[i], spec, i * ids, ids, n_ctx) for i in range(n_slots)]
