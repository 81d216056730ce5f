"""Gemma 4's "assistant" GGUF (architecture `gemma4-assistant`, `-md assistant.gguf`) as an MTP drafter.

Gemma 4 ships its multi-token-prediction drafter as a file of its own, which
llama-server runs with `-md gemma-4-assistant.gguf --spec-type draft-mtp`. In
llama.cpp 0.3.36 (docs/gemma4-assistant.md reads it in full):
  - Its context must be made with `ctx_other` = the target's context
    (src/llama-context.cpp:147-153): `LlamaContext(other=target)` here.
  - It has no KV cache of its own. Its memory is an iswa cache whose layers
    are the target's last sliding-window layer (n_layer - 2) and last full
    layer (n_layer - 1) and whose cells are the target's
    (src/llama-model.cpp:2809-2836; src/llama-kv-cache.cpp:85-97); removing,
    copying, keeping cells and writing a batch's are no-ops for it
    (src/llama-kv-cache.cpp:382-386, 451-455, 1097-1101); but clearing it
    does empty the target's cells (`clear` has no such guard, :369-373), so
    nothing here clears the assistant's memory. Each block's
    attention has a query only (src/models/gemma4-assistant.cpp:150-151): a
    row attends its sequence's target cells up to its position and writes
    none. llama.cpp's batch check still asks a row at position p to follow
    the sequence's last cell, p - 1 (src/llama-batch.cpp:321-346).
  - A row is (token, h): the *target's* embedding of the token, scaled,
    beside h, a hidden row of the target's width (gemma4-assistant.cpp:
    105-114); its outputs are logits and h_next (:186-193), n_embd_out wide
    (src/llama-context.cpp:2143).
  - common/speculative.cpp's `common_speculative_impl_draft_mtp` sees the
    shared memory (`is_mem_shared`, :1420), so it chains no heads (all blocks
    run in one graph, :1421), decodes no catch-up in process() (:1508) and
    keeps only pending_h, the target's hidden row (post-norm,
    src/models/gemma4.cpp:408-415) of the last accepted token (:1565-1580,
    accept() :1743). draft() decodes (id_last, pos0, pending_h) (:1604),
    then each drafted token at the same position pos0 with the assistant's
    own h_next of the row before (:1697-1702, after transformers'
    gemma4_assistant.md); pos0 is the slot's cached tokens
    (tools/server/server-context.cpp:3010).

Here (`AssistantSequence`, behind KvSequence's seam like backends.mtp):
  - Its record is its slot's target sequence's (`follow`): it holds no cell,
    what it reads are the target's. So a strategy's prefill decodes nothing
    on it, `auto` finds it never behind (no catch-up to price), save/restore
    and copy_prefix have nothing to move, and its context, asked for its
    cells, answers with the target's (src/llama-kv-cache.cpp:661-676):
    `owns_cells` is False, so the server's `kv_cells`, the slots'
    consistency check, the prompt cache and KV files count the target's
    cells once, through the target's sequence.
  - `syncing(context)` decodes the one row (context[-1], p, h) with
    p = len(context) - 1, h the target's row of (p - 1, context[p - 1]),
    kept by backends.mtp's HiddenStash after the target's decode (as
    process() copies verify_h), zeros where it is gone.
  - `extending([t])` decodes (t, p, the last row's h_next): one decode per
    drafted token, each row depending on the one before.
  - Trees: a node's row is (its token, p, its parent's h_next), which is what
    a chain along its path decodes (no row writes anything another reads),
    so a tree's level goes in one decode, every row on the slot's main
    sequence id (a position may repeat within a sequence in a batch).
  - A target that holds other than context[:-1] on the main sequence (which
    no strategy leaves) is drafted after anyway, at its next position:
    `misaligned` counts it; the output stays lossless.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Generator, Iterable, Sequence

import numpy as np

from backends.errors import ContextFullError
from backends.kv import KvSequence, Lane, common_prefix
from backends.llama import ContextConfig, LlamaContext, LlamaModel
from backends.llama_ext import enable_hidden, hidden_row, n_embd_out
from backends.mtp import KEEP_BEHIND, HiddenFeed, HiddenStash, MtpLane
from backends.steps import Decode, Rows
from models.errors import incompatible_pair

ASSISTANT_ARCHITECTURE = "gemma4-assistant"
TARGET_ARCHITECTURES = frozenset({"gemma4"})


class AssistantLane(MtpLane):
    """The assistant's context and batch: rows (token, position, sequence ids, wants logits, h), h of the
    target's width (the assistant's n_embd_out), not the assistant's own."""

    def __init__(self, ctx: LlamaContext, width: int, ids_per_token: int | None = None,
                 chunk: int | None = None) -> None:
        super().__init__(ctx, ids_per_token, chunk)
        self.width = width
        self.hidden_batch.n_embd = width
        self._zeros = np.zeros(width, dtype=np.float32)


class AssistantSequence(KvSequence):
    """One slot's view of the assistant: no cells of its own, its record the slot's target's."""

    label = "mtp"
    owns_cells = False  # its context answers with the target's cells: counted, saved and checked as the target's

    def __init__(self, lane: AssistantLane, stash: HiddenStash, base: int = 0, n_ids: int | None = None,
                 n_ctx: int | None = None) -> None:
        self._target: KvSequence | None = None
        super().__init__(lane, base, n_ids, n_ctx)
        self.stash = stash
        self.width = lane.width
        self.missing = 0  # first rows decoded with zeros for want of the target's state
        self.misaligned = 0  # syncings after a target that did not hold context[:-1]
        self._last_hidden: np.ndarray | None = None
        self._tips: dict[int, np.ndarray] = {}  # a tree's scratch sequences: h_next at each one's last node

    def follow(self, target: KvSequence) -> None:
        """Read `target`'s cells (the slot's target sequence, on the context this one's was made beside)."""
        self._target = target

    @property
    def tokens(self) -> list[int]:  # type: ignore[override]
        """What the assistant reads: its target's record (a copy: nothing is kept here)."""
        return list(self._target.tokens) if self._target is not None else []

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        pass  # KvSequence's own bookkeeping: the record is the target's

    def _pos(self, context: Sequence[int]) -> int:
        """Where the next row goes: after the target's last cell, which should be context[:-1]'s."""
        held = self._target.tokens if self._target is not None else []
        p = len(held)
        if p != len(context) - 1 or common_prefix(held, context) != p:
            self.misaligned += 1
        return p

    def _decode_one(self, token: int, pos: int, h: np.ndarray) -> Generator[Decode, list[int], int]:
        rows = yield Decode(self.lane, [(token, pos, (self.base,), True, h)])
        self.rows, self.last_row = rows, rows[-1]
        self._last_hidden = hidden_row(self.ctx, self.last_row, self.width).copy()
        return self.last_row

    def syncing(self, tokens: Sequence[int], logits: bool = True) -> Generator[Decode, list[int], int]:
        """Logits after `tokens` (the context): one row, (tokens[-1], p, the target's state at p - 1). Without
        logits nothing is decoded (llama.cpp's process() decodes no catch-up for an assistant, :1508)."""
        keep = common_prefix(self.tokens, tokens)
        if not logits or not tokens:
            return keep
        p = self._pos(tokens)
        if p + 1 > self.n_ctx:
            raise ContextFullError(f"{p + 1} tokens do not fit in the context of {self.n_ctx}")
        h = self.stash.get(p - 1, tokens[p - 1]) if 0 < p <= len(tokens) else None
        if h is None:
            h = self.stash.zeros()
            self.missing += p > 0
        self._tips.clear()
        yield from self._decode_one(tokens[-1], p, h)
        self.stash.drop_below(p - KEEP_BEHIND)
        return keep

    def extending(self, tokens: Sequence[int], logits: str = "last") -> Rows:
        """Drafted `tokens`, each at the same position as the row before, paired with its h_next (:1697-1702)."""
        if not tokens:
            return []
        p = len(self.tokens)
        rows: list[int] = []
        for tok in tokens:
            h = self._last_hidden if self._last_hidden is not None else self.stash.zeros()
            rows.append((yield from self._decode_one(tok, p, h)))
        self.rows = rows
        return rows

    def _tip(self, seq: int) -> np.ndarray:
        tip = self._last_hidden if seq == 0 else self._tips.get(seq, self._last_hidden)
        return tip if tip is not None else self.stash.zeros()

    def decoding(self, entries: Iterable[tuple[int, int, Iterable[int], bool]]) -> Rows:
        """A tree's nodes, each (token, p, its path's h_next) on the slot's main sequence id, in one decode."""
        entries = [(tok, tuple(seqs), want) for tok, _, seqs, want in entries]
        p = len(self.tokens)
        for _, seqs, _ in entries:
            self._ids(seqs)  # the tree's local ids stay within the slot's
        rows = yield Decode(self.lane, [(tok, p, (self.base,), want, self._tip(seqs[0]))
                                        for tok, seqs, want in entries])
        for (_, seqs, want), row in zip(entries, rows):
            if want:
                h = hidden_row(self.ctx, row, self.width).copy()
                for seq in seqs:
                    if seq == 0:
                        self._last_hidden = h
                    else:
                        self._tips[seq] = h
        return rows

    # -- cells: none of its own ---------------------------------------------------------------------

    def fork(self, src: int, dst: int) -> None:
        self._ids((src, dst))
        self._tips[dst] = self._tip(src)

    def drop_seq(self, seq: int) -> None:
        self._tips.pop(seq, None)

    def keep_branch(self, context: Sequence[int], keep: int, best_seq: int, reshare: int = 0) -> None:
        self._tips.clear()

    def truncate(self, n: int) -> None:
        pass

    def cut(self, n: int) -> int:
        return min(n, len(self.tokens))

    def drop_cells_from(self, pos: int) -> None:
        pass

    def share_with(self, n_seqs: int) -> None:
        pass

    def copy_prefix(self, src: KvSequence, n: int) -> None:
        pass

    def save(self) -> bytearray:
        return bytearray()  # nothing: kept caches and KV files keep the target's cells alone

    def restore(self, tokens: Sequence[int], state: bytearray) -> bool:
        return list(tokens) == self.tokens  # nothing to put back: it holds what the target holds

    def reset(self) -> None:
        self._last_hidden = None
        self._tips.clear()
        self.stash.clear()
        self._hi = 1

    def cells(self) -> int:
        """The cells its context answers for on its main sequence: the target's (the cache is shared), which is
        why it does not own them (`owns_cells`) and no count of a slot's cells adds these."""
        return self.ctx.pos_max(self.base) + 1


def check_assistant(target: LlamaModel, assistant: LlamaModel) -> int:
    """The hidden width the assistant reads, as llama.cpp loaded it; a ModelError line when it does not fit
    `target` (llama.cpp would read past the target's rows or embeddings, or find no layers to share)."""
    arch, width = target.info.architecture, n_embd_out(assistant)
    problems = []
    if arch not in TARGET_ARCHITECTURES:
        problems.append(f"a Gemma 4 assistant drafts for a gemma4 target, this one is {arch}")
    if width != target.n_embd:
        problems.append(f"it reads hidden states of {width}, the target's are {target.n_embd}")
    if assistant.n_vocab != target.n_vocab:
        problems.append(f"its vocabulary has {assistant.n_vocab} tokens, the target's {target.n_vocab}")
    if problems:
        raise incompatible_pair(target.path.name, assistant.path.name, problems)
    return width


def assistant_lanes(target: Lane, assistant: LlamaModel, config: ContextConfig, ids: int, chunk: int | None,
                    n_slots: int, n_ctx: int) -> tuple[AssistantLane, list[AssistantSequence]]:
    """The assistant's context beside the target's (ctx_other), its lane, and one AssistantSequence per slot
    (each to `follow` its slot's target sequence), fed with the target lane's hidden rows from now on
    (llama_set_embeddings_nextn: the target's unmasked, the assistant's masked, common/speculative.cpp:1417-1418)."""
    width = check_assistant(target.ctx.model, assistant)
    ctx = LlamaContext(assistant, replace(config, n_rs_seq=0), other=target.ctx)  # attention only
    try:
        enable_hidden(target.ctx, masked=False)
        enable_hidden(ctx, masked=True)
        lane = AssistantLane(ctx, width, ids, chunk)
    except BaseException:
        ctx.close()
        raise
    stashes = [HiddenStash(i * ids, ids, width, cap=max(256, n_ctx)) for i in range(n_slots)]
    target.followers.append(HiddenFeed(target.ctx, stashes))
    return lane, [AssistantSequence(lane, stashes[i], i * ids, ids, n_ctx) for i in range(n_slots)]

