"""An EAGLE-3 draft (`-md head.gguf` of architecture `eagle3`) as a drafter: the MTP head's seam, another source.

llama.cpp's `common_speculative_impl_draft_eagle3` (common/speculative.cpp
:421-921 in the version vendored in llama-cpp-python 0.3.36; read in
docs/eagle3-protocol.md) runs a one-layer draft beside the target. The target
outputs the *inputs* of three of its layers (`eagle3.target_layers`); the
draft's encoder (`fc`, LLAMA_PROCESS_TYPE_ENCODE) turns their concatenation at
position P into g_P; its decoder row at position P is the pair (t_{P+1}, g_P),
whose logits predict t_{P+2}, and a drafted token is fed with the decoder's
own pre-norm output in place of g (:738-859).

That is MTP's row (x_p, h_{p-1}) (backends.mtp) with g in place of h, so an
EAGLE-3 draft is an `MtpSequence` of an `MtpLane` and everything built on them
(sps, `auto`'s chains, the device cost, the scheduler's draft lane, KV files)
runs it unchanged. What differs is kept here:
  - Positions. llama.cpp writes the row for token p = P + 1 at position
    P = p - 1; here it goes at position p, the token's own, as an MTP row
    does. The draft's attention sees positions only through RoPE, whose
    scores depend on position differences alone (src/models/eagle3.cpp:
    241-255, plain `ggml_rope_ext` and a causal mask), so every row computes what
    llama.cpp's does, and the draft's cells line up with the target's: cell
    p <-> token p, which keeps KvSequence's truncate, copy_prefix, save and
    restore as they are. The first token has no row (llama.cpp's neither);
    a context of one token gets a placeholder row (t_0, zeros), never kept.
  - The hidden source. After every target decode `LayerFeed` (a follower of
    the target's lane, like HiddenFeed) copies each slot's rows of the three
    layer inputs into its stash, by (position, token), before the next
    decode overwrites them (llama.cpp's process(), :593-640, does it at the
    same moment). They are *encoded lazily*, in the draft lane's next decode
    (`Eagle3Lane._hidden`), as the MTP head catches up lazily: `ar`, or
    `auto` not drafting, pays nothing for the draft; the rows of several
    slots are encoded in one batch; and the encoder, which overwrites the
    draft context's outputs, runs only where a draft-lane decode would (not
    in the middle of the scheduler's target decode, nor between a draft
    decode and the reading of its logits). A stash holds up to its slot's
    context of rows, 3 x n_embd_target floats each, until the draft reads
    them; it keeps a few behind (backends.mtp.KEEP_BEHIND) and the first
    token's. A row whose state is gone (the same prompt again: the target
    keeps its cells, the draft re-decodes its last row for logits) is
    paired with zeros, where llama.cpp's draft() pairs it with the last
    request's stale `pending_g`: drafts degrade there, never the output.
  - The target. Only some graphs record their layers' inputs: llama.cpp
    aborts the process on any other (`LAYER_INPUT_TARGETS`), so such a
    target, or a draft whose layers it lacks, is refused in one line
    (`check_eagle3`), after the header check of models.compat.
  - The outputs. llama.cpp's eagle3 decoder graph computes the logits and
    pre-norm state of *every* row (it has no `inp_out_ids` selection,
    src/models/eagle3.cpp:152-324), but the context copies out only the first
    n_outputs rows of them (src/llama-context.cpp:1938-1948, and the nextn
    rows after it), as if they were the rows that asked: in a batch of rows
    that ask and rows that do not, a row's logits are another row's.
    llama.cpp never mixes them (process() asks for none, draft() decodes one
    row at a time); here a syncing ends its catch-up with the row it wants
    logits of, and the scheduler packs one slot's catch-up with another's
    drafts. Nor may the batch be reordered: llama.cpp refuses positions that
    decrease within a sequence. So `Eagle3Lane._passes` decodes such a batch
    in two: each request's rows before its first that asks, asking for
    nothing, then the others, every one asking (as llama.cpp's process()
    then draft()). Measured on the fixture: one mixed batch gave the draft
    another row's argmax.
  - The vocabulary. A draft with a `d2t` map proposes from part of the
    target's vocabulary: llama.cpp returns n_vocab-wide logits, -inf outside
    it (eagle3.cpp:307-320). `sampling.probabilities` and `argmax` cope with
    -inf, but a grammar that masks every token of the draft's vocabulary
    would leave no finite logit, and q would be NaN. So the draft's -inf are
    raised to a finite floor, -1e30, whose probability beside any logit the
    draft gives is 0: q is unchanged wherever the draft can propose, and a
    proper distribution (uniform over what the grammar allows) where it cannot.
"""

from __future__ import annotations

import time
from typing import Generator, Sequence

import numpy as np

from backends.kv import Lane
from backends.llama import ContextConfig, LlamaContext, LlamaModel
from backends.llama_ext import (EncodeBatch, enable_hidden, enable_layer_inputs, hidden_row, layer_input_rows,
                                n_layer, target_layer_ids)
from backends.mtp import HiddenStash, MtpLane, MtpSequence
from backends.steps import Decode, Entry
from models.errors import incompatible_pair

# The targets whose graph in llama.cpp 0.3.36 records its layers' inputs (`res->t_layer_inp[il]`, src/models/*.cpp):
# for any other, llama.cpp aborts at the first decode that asks for them (src/llama-graph.cpp:1384). Those of them
# that also give their final pre-norm state (`res->t_h_nextn`): a draft may read layer n_layer of these only.
LAYER_INPUT_TARGETS = frozenset({
    "llama", "nanbeige", "qwen3", "qwen3moe", "gemma4", "muse-glimmer", "deepseek4", "nemotron_h", "bailingmoe3",
    "hunyuan_vl", "gpt-oss", "lfm2", "minimax-01", "minimax-m2", "qwen3next", "qwen35", "qwen35moe", "mimo2",
    "qwen4exp",
})
FINAL_STATE_TARGETS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "mimo2", "nemotron_h", "gpt-oss", "qwen35", "qwen35moe", "qwen3next",
})

# Where the draft's -inf logits (tokens outside its d2t vocabulary) are raised to: so far below any logit it gives
# that they weigh nothing beside one (exp underflows to 0), yet finite (see the module's docstring).
LOGIT_FLOOR = np.float32(-1e30)


class Features:
    """One row of the target's three layer inputs (3 x n_embd_target), which the draft lane encodes into g."""

    __slots__ = ("row",)

    def __init__(self, row: np.ndarray) -> None:
        self.row = row


class LayerFeed:
    """Called by the target's lane after every decode (Lane.followers): hands each slot's rows of the draft's
    three layer inputs, concatenated, to its stash."""

    def __init__(self, ctx: LlamaContext, layers: Sequence[int], stashes: Sequence[HiddenStash]) -> None:
        self.ctx = ctx
        self.layers = tuple(layers)
        self.stashes = list(stashes)

    def __call__(self, requests: Sequence[Sequence[Entry]], rows: Sequence[Sequence[int]]) -> None:
        n = sum(map(len, requests))
        if n == 0:
            return
        views = None
        for entries, rws in zip(requests, rows):
            for stash in self.stashes:
                if stash.owns(entries):
                    if views is None:  # read once per decode, and only when a slot has a draft to feed
                        views = [layer_input_rows(self.ctx, lid, n) for lid in self.layers]
                    at = np.asarray(rws)
                    stash.keep(entries, np.concatenate([v[at] for v in views], axis=1))


class Eagle3Lane(MtpLane):
    """The draft's context and batch: entries are (token, position, sequence ids, wants logits, g), g being the
    draft's own pre-norm row (a drafted token's), `Features` to encode first, or None for zeros."""

    def __init__(self, ctx: LlamaContext, width: int, ids_per_token: int | None = None,
                 chunk: int | None = None) -> None:
        super().__init__(ctx, ids_per_token, chunk)
        self.encoder = EncodeBatch(ctx, width)
        self.encoded = 0  # rows encoded so far
        self.split = 0  # decodes made in two passes so far

    def _passes(self, requests: Sequence[Sequence[Entry]]) -> list[tuple[list[int], list[Entry]]] | None:
        """One decode when every row asks for outputs or none does; else two (see the module's docstring): each
        request's rows before its first that asks, asking for nothing, then the rest, all asking."""
        flat = [e for entries in requests for e in entries]
        if all(e[3] for e in flat) or not any(e[3] for e in flat):
            return None
        lead: list[int] = []
        rest: list[int] = []
        i = 0
        for entries in requests:
            first = next((j for j, e in enumerate(entries) if e[3]), len(entries))
            lead += range(i, i + first)
            rest += range(i + first, i + len(entries))
            i += len(entries)
        self.split += 1
        passes = [(rest, [flat[i][:3] + (True,) for i in rest])]
        return [(lead, [flat[i][:4] for i in lead])] + passes if lead else passes

    def _hidden(self, flat: Sequence[Entry]) -> np.ndarray:
        """g for every entry: the Features of all entries encoded in one pass (before the decode: the encoder
        overwrites the context's outputs), the others as they are."""
        todo = [i for i, e in enumerate(flat) if len(e) > 4 and isinstance(e[4], Features)]
        if not todo:
            return super()._hidden(flat)
        t0 = time.perf_counter()
        g = self.encoder.encode(np.stack([flat[i][4].row for i in todo]))
        self.prepare_seconds = time.perf_counter() - t0
        self.encoded += len(todo)
        out = super()._hidden([e[:4] if len(e) > 4 and isinstance(e[4], Features) else e for e in flat])
        out[np.asarray(todo)] = g
        return out


class Eagle3Sequence(MtpSequence):
    """One slot's share of the EAGLE-3 draft's context: rows (t_p, g_{p-1}) at position p, for p >= 1."""

    label = "eagle3"

    def _catch_up(self, tokens: Sequence[int], start: int, stop: int) -> list[tuple]:
        """The rows (t_p, g_{p-1}) for positions start .. stop-1 but 0 (the first token has none), each with the
        target's features to encode, zeros where the stash has none."""
        out = []
        for p in range(max(start, 1), stop):
            f = self.stash.get(p - 1, tokens[p - 1])
            if f is None:
                self.missing += 1
            out.append((tokens[p], p, (self.base,), False, None if f is None else Features(f)))
        return out

    def syncing(self, tokens: Sequence[int], logits: bool = True) -> Generator[Decode, list[int], int]:
        if not (logits and len(tokens) == 1):
            return (yield from super().syncing(tokens, logits))
        # Logits after the first token alone: it has no row (llama.cpp never drafts before the target's first
        # token). A placeholder (t_0, zeros) gives some; unpaired, it goes at the next syncing.
        self.truncate(0)
        rows = yield Decode(self.lane, [(tokens[0], 0, (self.base,), True, None)])
        self.tokens, self.paired = [tokens[0]], 0
        self.rows, self.last_row = rows, rows[-1]
        self._last_hidden = hidden_row(self.ctx, self.last_row).copy()
        return 0

    def drop_cells_from(self, pos: int) -> None:
        # The first token has no cell: keeping it alone keeps none (KvSequence would expect one at position 0).
        super().drop_cells_from(pos if pos > 1 else 0)

    def logits(self, row: int | None = None):
        """The draft's logits, -inf outside its vocabulary raised to LOGIT_FLOOR (in place: a view of llama.cpp's,
        valid until the lane's next decode)."""
        out = super().logits(row)
        np.maximum(out, LOGIT_FLOOR, out=out)
        return out


def check_eagle3(target: LlamaModel, draft: LlamaModel) -> tuple[int, ...]:
    """The target layers `draft` reads, as llama.cpp loaded it; a ModelError line when they do not fit `target`
    (llama.cpp would abort or fail: common/speculative.cpp:500-505, 541-549; src/llama-context.cpp:1240, 1481)."""
    layers, top = target_layer_ids(draft), n_layer(target)
    width = draft.info.eagle3_hidden if getattr(draft.info, "eagle3_hidden", None) else target.n_embd
    arch = target.info.architecture
    problems = []
    if arch not in LAYER_INPUT_TARGETS:
        problems.append(f"llama.cpp 0.3.36 gives no layer inputs of a {arch} target")
    elif top in layers and arch not in FINAL_STATE_TARGETS:
        problems.append(f"it reads the target's final state (layer {top}), which llama.cpp 0.3.36 gives of no "
                        f"{arch} model")
    if len(layers) != 3:
        problems.append(f"an EAGLE-3 draft reads 3 target layers, this one names {len(layers)}")
    too_deep = [i for i in layers if not 0 <= i <= top]
    if too_deep:
        problems.append(f"it reads layers {too_deep}, the target has {top}")
    if width != target.n_embd:
        problems.append(f"it reads hidden states of {width}, the target's are {target.n_embd}")
    if draft.n_vocab != target.n_vocab:
        problems.append(f"its vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}")
    if problems:
        raise incompatible_pair(target.path.name, draft.path.name, problems)
    return layers


def eagle3_lanes(target: Lane, draft: LlamaModel, config: ContextConfig, ids: int, chunk: int | None,
                 n_slots: int, n_ctx: int) -> tuple[Eagle3Lane, list[Eagle3Sequence]]:
    """The draft's context beside the target's (ctx_other, as common/speculative.cpp:2529-2535 makes it), its
    lane, and one Eagle3Sequence per slot, fed with the target lane's layer inputs from now on."""
    layers = check_eagle3(target.ctx.model, draft)
    ctx = LlamaContext(draft, config, other=target.ctx)
    try:
        enable_layer_inputs(target.ctx, layers)
        enable_hidden(ctx, masked=True)  # the decoder's pre-norm rows (fed back), and the encoder's g
        width = len(layers) * target.ctx.model.n_embd
        lane = Eagle3Lane(ctx, width, ids, chunk)
    except BaseException:
        ctx.close()
        raise
    stashes = [HiddenStash(i * ids, ids, width, cap=max(256, n_ctx)) for i in range(n_slots)]
    target.followers.append(LayerFeed(target.ctx, layers, stashes))
    return lane, [Eagle3Sequence(lane, stashes[i], i * ids, ids, n_ctx) for i in range(n_slots)]
