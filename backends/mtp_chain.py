"""A model's several MTP heads chained, draft k by head k: llama.cpp's `chain_heads` mode, beside backends.mtp.

Follows common/speculative.cpp's `common_speculative_impl_draft_mtp` (the
version vendored in llama-cpp-python 0.3.36) where the model has
n_mtp_layers = llama_model_n_layer_nextn > 1 heads and does not share the
target's memory (`chain_heads`, :1421). Only the MTP graphs of step35, mimo2
and hy_v3 run any of several heads, the one picked by
`llama_set_nextn_layer_offset` (src/models/step35.cpp:376, mimo2.cpp:276,
hy-v3.cpp:245, `il = n_layer() + nextn_layer_offset`); every other MTP graph
asserts a single block (models.drafters.CHAINED_MTP_ARCHITECTURES). Each head
is a decoder layer with its own keys and values in the one MTP context, so:
  - Rows paired with the target's hidden states (the accepted text) are
    decoded once per head, the sequence's cells from the rows' first position
    removed before each head (process(), :1534-1557): every head's layer
    then holds them.
  - A chain is at most one draft per head (n_max = min(n_max, n_mtp_layers),
    :1423: `depth_max` here). Its step i removes the draft region (from pos0,
    the last committed token's position) and decodes the whole prefix again
    under head i: rows t = 0..i are (token t, pos0 + t, chain_h[t]), chain_h[0]
    the target's state before pos0, chain_h[t] the hidden output of step t-1 at
    its last row (:1615-1697), logits on the last row only.
  - A tree's path is such a chain: a node at depth d is decoded with its
    path's rows under head d, on the path's own scratch sequence, so a tree is
    at most as deep as the heads are many.

Where this differs from llama.cpp's driver, and why:
  - The last committed token's row (x_{n-1}, h_{n-2}) is the chain's first
    step (head 0) and is not counted as paired: the next `syncing` decodes it
    again under every head, as llama.cpp's process() does with the
    verification batch that starts with it.
  - Sequences drafting at different depths (the scheduler's slots are not in
    step) need different heads in one tick: the lane decodes one pass per head
    and, since only the last decode's outputs can be read, copies each pass's
    logits and hidden rows out (`ChainedMtpLane.out_logits`, `out_hidden`).
Head k's cells for a position are written by its own decode. Between heads
llama.cpp removes the cells and decodes again, relying on llama_kv_cache
finding the same cells (its head moves back to the first freed cell,
src/llama-kv-cache.cpp:418); the same calls in the same order here. Were a
head's cells lost, its drafts would degrade, never the output: verification
keeps it lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Iterable, Sequence

import numpy as np

from backends.errors import ContextFullError
from backends.kv import KvSequence, Lane
from backends.llama import LlamaContext
from backends.llama_ext import hidden_row, set_nextn_layer_offset
from backends.mtp import KEEP_BEHIND, HiddenStash, MtpLane, MtpSequence
from backends.mtp import mtp_lanes as one_head_lanes
from backends.steps import Decode, Entry, Rows

# An entry on a chained lane: (token, position, sequence ids, wants output, hidden row or None, head), the head
# None for a row paired with the target's state, which every head decodes.
EVERY_HEAD = None


@dataclass(frozen=True)
class Path:
    """A chain of rows after a sequence's paired cells: its tokens (the first at position pos0), the hidden row
    each was decoded with, and the hidden output of its last row (the next row's), None when unknown."""

    tokens: tuple[int, ...] = ()
    feats: tuple[np.ndarray, ...] = ()
    tip: np.ndarray | None = None

    def then(self, token: int, feat: np.ndarray, tip: np.ndarray) -> "Path":
        return Path(self.tokens + (token,), self.feats + (feat,), tip)

    def cut(self, n: int) -> "Path":
        """Its first n rows (the output of row n-1 is what row n was decoded with)."""
        if n >= len(self.tokens):
            return self
        return Path(self.tokens[:n], self.feats[:n], self.feats[n]) if n > 0 else Path()


def first_positions(entries: Iterable[Entry]) -> dict[int, int]:
    """Each sequence id's first position among `entries`: where its cells are removed from before a pass."""
    first: dict[int, int] = {}
    for e in entries:
        for s in e[2]:
            first[s] = min(first.get(s, e[1]), e[1])
    return first


class ChainedMtpLane(MtpLane):
    """The MTP context of a model with `n_heads` chained heads: each decode is one pass per head its entries
    need, and the outputs of every pass are copied out (`out_logits`, `out_hidden`, indexed by the rows
    returned, -1 for an entry that wanted none), valid until the next decode."""

    def __init__(self, ctx: LlamaContext, n_heads: int, ids_per_token: int | None = None,
                 chunk: int | None = None) -> None:
        super().__init__(ctx, ids_per_token, chunk)
        self.n_heads = n_heads
        self.out_logits: list[np.ndarray] = []
        self.out_hidden: list[np.ndarray] = []

    def _pass(self, head: int, entries: Sequence[Entry]) -> tuple[float, list[int]]:
        """Decode `entries` under `head`, their sequences' cells removed from their first position first."""
        for seq, pos in first_positions(entries).items():
            self.ctx.seq_rm(seq, pos, -1)
        set_nextn_layer_offset(self.ctx, head)
        self.hidden_batch.fill([e[:4] for e in entries], self._hidden(entries))
        seconds = self.hidden_batch.process()
        rows = []
        for i, e in enumerate(entries):
            rows.append(len(self.out_logits) if e[3] else -1)
            if e[3]:
                self.out_logits.append(self.ctx.logits(i).copy())
                self.out_hidden.append(hidden_row(self.ctx, i).copy())
        return seconds, rows

    def decode(self, requests: Sequence[Sequence[Entry]]) -> list[list[int]]:
        flat = [e for entries in requests for e in entries]
        self.out_logits, self.out_hidden = [], []
        self.prepare_seconds = seconds = 0.0
        at = [-1] * len(flat)
        every = [i for i, e in enumerate(flat) if e[5] is EVERY_HEAD]
        try:
            for head in range(self.n_heads) if every else ():  # the paired rows: every head's layer holds them
                seconds += self._pass(head, [flat[i] for i in every])[0]
            for head in sorted({e[5] for e in flat if e[5] is not EVERY_HEAD}):
                idx = [i for i, e in enumerate(flat) if e[5] == head]
                s, rows = self._pass(head, [flat[i] for i in idx])
                seconds += s
                for i, row in zip(idx, rows):
                    at[i] = row
        finally:
            set_nextn_layer_offset(self.ctx, 0)  # as llama.cpp leaves it for other decodes
        self.last_rows = n = len(flat)
        if n and not every:  # draft steps only: the shape speculation is priced with
            self.live.observe(n, seconds)
        out, i = [], 0
        for entries in requests:
            out.append(at[i:i + len(entries)])
            i += len(entries)
        return out


class ChainedMtpSequence(MtpSequence):
    """One slot's share of a chained heads' MTP context. `paired` counts the cells every head holds; the rows
    after them are sequence 0's chain (`_paths[0]`, its tokens those of `tokens` from `paired` on), and a
    tree's scratch sequences have chains of their own."""

    def __init__(self, lane: ChainedMtpLane, stash: HiddenStash, base: int = 0, n_ids: int | None = None,
                 n_ctx: int | None = None) -> None:
        super().__init__(lane, stash, base, n_ids, n_ctx)
        self.chained: ChainedMtpLane = lane
        self.depth_max = lane.n_heads
        self._paths: dict[int, Path] = {}

    def _state_before(self, pos: int) -> np.ndarray:
        """The target's hidden state at pos - 1 (zeros where the stash has none)."""
        h = self.stash.get(pos - 1, self.tokens[pos - 1]) if 0 < pos <= len(self.tokens) else None
        return h if h is not None else self.stash.zeros()

    def _path_rows(self, path: Path, token: int, ids: tuple[int, ...]) -> list[Entry]:
        """The rows that draft after `token` at the end of `path`: the path again and the token, under the head
        of its depth, the token paired with the path's last output (the target's state on an empty path)."""
        head, pos0 = len(path.tokens), self.paired
        if head >= self.chained.n_heads:
            raise ValueError(f"the model's {self.chained.n_heads} chained MTP heads draft at most "
                             f"{self.chained.n_heads} tokens a step")
        feat = path.tip if path.tokens else self._state_before(pos0)
        feat = feat if feat is not None else self.stash.zeros()
        rows = [(t, pos0 + i, ids, False, f, head) for i, (t, f) in enumerate(zip(path.tokens, path.feats))]
        return rows + [(token, pos0 + head, ids, True, feat, head)]

    def logits(self, row: int | None = None):
        """A copy of the logits of row `row` of the lane's last decode (default: this sequence's last token's)."""
        return self.chained.out_logits[self.last_row if row is None else row]

    def syncing(self, tokens: Sequence[int], logits: bool = True) -> Generator[Decode, list[int], int]:
        """Make the head hold `tokens`, paired with the target's states under every head; with logits, the last
        row is the chain's first step instead (head 0), left unpaired for the next syncing to decode again."""
        keep, stop = self._catch_up_span(tokens, logits)
        rows: list[int] = []
        entries: list[Entry] = []
        for start in range(keep, stop, self.lane.chunk):
            end = min(stop, start + self.lane.chunk)
            entries = [e + (EVERY_HEAD,) for e in self._catch_up(tokens, start, end)]
            if logits and end == stop:
                entries[-1] = entries[-1][:3] + (True, entries[-1][4], 0)
            rows = yield Decode(self.lane, entries)
            self.tokens.extend(tokens[start:end])
        self.paired = len(self.tokens) - (1 if logits else 0)
        self.stash.drop_below(self.paired - KEEP_BEHIND)
        if logits:
            first = entries[-1]
            self._paths = {0: Path((first[0],), (first[4],), self.chained.out_hidden[rows[-1]])}
            self.rows, self.last_row = rows[-1:], rows[-1]
        return keep

    def extending(self, tokens: Sequence[int], logits: str = "last") -> Rows:
        """Draft steps: each token decoded with sequence 0's chain under the next head (one decode a token, so
        'all' is refused for several: only the last decode's outputs stay)."""
        if logits == "all" and len(tokens) > 1:
            raise ValueError("chained MTP heads decode one token a step: no logits for several at once")
        rows: list[int] = []
        for tok in tokens:
            if len(self.tokens) + 1 > self.n_ctx:
                raise ContextFullError(f"{len(self.tokens) + 1} tokens do not fit in the context of {self.n_ctx}")
            path = self._paths.get(0, Path())
            entries = self._path_rows(path, tok, (self.base,))
            out = yield Decode(self.lane, entries)
            self.tokens.append(tok)
            self._paths[0] = path.then(tok, entries[-1][4], self.chained.out_hidden[out[-1]])
            rows = [out[-1]]
        if rows:
            self.rows, self.last_row = rows, rows[-1]
        return rows

    def decoding(self, entries: Iterable[tuple[int, int, Iterable[int], bool]]) -> Rows:
        """A tree's nodes, each after its sequence's chain (one node a sequence), each under the head of its
        depth; every node's output is kept as its sequence's tip."""
        nodes = [(tok, pos, tuple(seqs)) for tok, pos, seqs, _ in entries]
        batch: list[Entry] = []
        last = []
        for tok, pos, seqs in nodes:
            path = self._paths.get(seqs[0], Path())
            if pos != self.paired + len(path.tokens):
                raise ValueError(f"a node at {pos} does not follow its sequence's chain "
                                 f"({self.paired} + {len(path.tokens)})")
            batch += self._path_rows(path, tok, self._ids(seqs))
            last.append(len(batch) - 1)
        if len({seqs[0] for _, _, seqs in nodes}) < len(nodes):
            raise ValueError("chained MTP heads decode one node a sequence at a time")
        out = yield Decode(self.lane, batch)
        rows = [out[i] for i in last]
        for (tok, _, seqs), i, row in zip(nodes, last, rows):
            path = self._paths.get(seqs[0], Path()).then(tok, batch[i][4], self.chained.out_hidden[row])
            for s in seqs:
                self._paths[s] = path
        return rows

    def fork(self, src: int, dst: int) -> None:
        KvSequence.fork(self, src, dst)
        self._paths[dst] = self._paths.get(src, Path())

    def drop_seq(self, seq: int) -> None:
        KvSequence.drop_seq(self, seq)
        self._paths.pop(seq, None)

    def truncate(self, n: int) -> None:
        if n >= len(self.tokens):
            return
        super().truncate(n)
        path = self._paths.get(0, Path()).cut(len(self.tokens) - self.paired)
        self._paths = {0: path} if path.tokens else {}

    def restore(self, tokens: Sequence[int], state: bytearray) -> bool:
        self._paths.clear()
        return super().restore(tokens, state)

    def keep_branch(self, context: Sequence[int], keep: int, best_seq: int, reshare: int = 0) -> None:
        """As a draft model's, then back to the paired cells: a kept chain's cells are not every head's."""
        super().keep_branch(context, keep, best_seq, reshare)
        self._paths.clear()
        self.truncate(self.paired)

    def reset(self) -> None:
        super().reset()
        self._paths.clear()


def mtp_lanes(target: Lane, ctx: LlamaContext, ids: int, chunk: int | None, n_slots: int, n_ctx: int,
              ) -> tuple[MtpLane, list[MtpSequence]]:
    """The lanes of the target model's MTP context: chained heads where the model loaded several, else its one
    head's (backends.mtp)."""
    n_heads = ctx.model.n_layer_nextn
    if n_heads <= 1:
        return one_head_lanes(target, ctx, ids, chunk, n_slots, n_ctx)
    return one_head_lanes(target, ctx, ids, chunk, n_slots, n_ctx, lane=ChainedMtpLane(ctx, n_heads, ids, chunk),
                          sequence=ChainedMtpSequence)
