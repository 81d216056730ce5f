"""A model's own MTP (multi-token prediction) head as a drafter: the same seam as a draft model's sequence.

llama.cpp's `common_speculative_impl_draft_mtp` (common/speculative.cpp, the
version vendored in llama-cpp-python 0.3.36) runs a GGUF's NextN layers in a
second context of the same weights (LLAMA_CONTEXT_TYPE_MTP). Its row at
position p is the pair (token x_p, the target's hidden state h_{p-1} at the
position before), and its logits there predict the token at p + 1: h_{p-1}
already predicted x_p, so the head looks one token further. To draft after a
context of n tokens, the head holds the rows 0 .. n-2 (each paired with the
target's hidden state), decodes (x_{n-1}, h_{n-2}) for the first draft token,
then feeds each drafted token with its *own* hidden output, as deep as the
chain goes (Qwen3.5's one head reused). A model with several heads chains
them, draft k by head k (llama.cpp's `chain_heads` mode: step35, mimo2,
hy_v3): backends.mtp_chain, built on the classes here.

Here the head is a `KvSequence` of its own lane (`MtpSequence`), so
everything built on a draft model's sequence (`sps`, `auto`'s chains, the
device cost, the prompt cache, KV files, the scheduler's draft lane) runs on
it unchanged. What differs is kept here:
  - The target's lane hands every decode's hidden rows to a `HiddenStash`
    per slot (by position and token), and the head takes them when it
    catches up: lazily, at its next `syncing`, in one batch with the first
    draft row, instead of after every target decode as llama-server does.
    `ar`, or `auto` deciding not to draft, pays nothing for the head.
  - Rows the head drafted are not paired with the target's states: the
    cells beyond `paired` are dropped at the next `syncing`, and the
    accepted tokens are decoded again, paired, as llama.cpp's process() does.
A hidden state the stash lacks (cells restored from a cache the target did
not decode in this process) is read as zeros, as llama.cpp starts its own
`pending_h`: drafts degrade there, never the output, which verification keeps
lossless.

An EAGLE-3 draft (backends.eagle3) is this mechanism with another hidden
source: its row for token p is (t_p, g_{p-1}), g an encoding of three target
layers, so it subclasses MtpSequence and MtpLane through three small hooks
here: `HiddenStash.owns`/`keep` (a feed that builds its rows only for the
slot that owns them), `MtpLane._hidden` and `_passes` (the lane turns entries
into hidden rows and decodes them: EAGLE-3 encodes there, and decodes the rows
that want no output before those that do) and a catch-up chunk that may have
no rows (EAGLE-3 has none for the first token).
"""

from __future__ import annotations

from typing import Generator, Iterable, Sequence

import numpy as np

from backends.errors import ContextFullError
from backends.kv import KvSequence, Lane, common_prefix
from backends.llama import LlamaContext
from backends.llama_ext import HiddenBatch, enable_hidden, hidden_row, hidden_rows
from backends.steps import Decode, Entry, Rows


# Rows of the target's states the head has read that its stash keeps behind the last: a next context that leaves
# the head's record a few tokens before its end (a chat template that ends the answer otherwise than it was
# generated) finds the state its first new row pairs with, which the target, keeping its cells, decodes no more.
KEEP_BEHIND = 8


class HiddenStash:
    """The target's hidden rows of one slot (sequence ids base .. base + n_ids - 1), by (position, token),
    until its head has read them. Bounded: past `cap` rows (a strategy that never drafts), the lowest
    positions go."""

    def __init__(self, base: int, n_ids: int, n_embd: int, cap: int) -> None:
        self.lo, self.hi, self.n_embd, self.cap = base, base + n_ids, n_embd, cap
        self.rows: dict[tuple[int, int], np.ndarray] = {}
        self._zeros = np.zeros(n_embd, dtype=np.float32)

    def owns(self, entries: Sequence[Entry]) -> bool:
        """Whether a request's `entries` are this slot's (a request's entries are all one sequence's)."""
        return bool(entries) and self.lo <= entries[0][2][0] < self.hi

    def take(self, entries: Sequence[Entry], rows: Sequence[int], hidden: np.ndarray) -> None:
        """Keep the hidden rows of `entries` (decoded at `rows` of a batch whose rows are `hidden`) if they are
        this slot's."""
        if self.owns(entries):
            self.keep(entries, hidden[np.asarray(rows)])  # one copy of the request's rows

    def keep(self, entries: Sequence[Entry], copied: np.ndarray) -> None:
        """Keep `copied[i]` as the row of `entries[i]` (the dict keeps views of `copied`)."""
        for i, e in enumerate(entries):
            self.rows[(e[1], e[0])] = copied[i]
        if len(self.rows) > self.cap:
            top = max(p for p, _ in self.rows)
            self.drop_below(top - self.cap // 2)

    def get(self, pos: int, token: int) -> np.ndarray | None:
        return self.rows.get((pos, token))

    def zeros(self) -> np.ndarray:
        return self._zeros

    def drop_below(self, pos: int) -> None:
        """Forget the rows of positions below `pos` (the head has read them), but position 0's: the first token's
        state depends on no other, so a request that shares only it with the last (a new prompt after the
        same BOS) pairs its row 1 with it, though the target keeps its cell and decodes it no more."""
        self.rows = {k: v for k, v in self.rows.items() if k[0] >= pos or k[0] == 0}

    def clear(self) -> None:
        self.rows.clear()


class HiddenFeed:
    """Called by the target's lane after every decode (Lane.followers): hands the batch's hidden rows to the
    slots' stashes."""

    def __init__(self, ctx: LlamaContext, stashes: Sequence[HiddenStash]) -> None:
        self.ctx = ctx
        self.stashes = list(stashes)

    def __call__(self, requests: Sequence[Sequence[Entry]], rows: Sequence[Sequence[int]]) -> None:
        n = sum(map(len, requests))
        if n == 0:
            return
        hidden = hidden_rows(self.ctx, n)
        for entries, rws in zip(requests, rows):
            for stash in self.stashes:
                stash.take(entries, rws, hidden)


class MtpLane(Lane):
    """The MTP context and its batch, whose rows carry a hidden state: entries are (token, position,
    sequence ids, wants logits, hidden state or None for zeros)."""

    def __init__(self, ctx: LlamaContext, ids_per_token: int | None = None, chunk: int | None = None) -> None:
        super().__init__(ctx, ids_per_token, chunk)
        self.hidden_batch = HiddenBatch(ctx)
        self._zeros = np.zeros(ctx.model.n_embd, dtype=np.float32)
        self.prepare_seconds = 0.0  # what making the last decode's hidden rows took in llama.cpp (EAGLE-3)

    def _hidden(self, flat: Sequence[Entry]) -> np.ndarray:
        """The hidden row each entry is decoded with, stacked (zeros where it has none)."""
        if not flat:
            return np.zeros((0, self._zeros.size), dtype=np.float32)
        return np.stack([e[4] if len(e) > 4 and e[4] is not None else self._zeros for e in flat])

    def _passes(self, requests: Sequence[Sequence[Entry]]) -> list[tuple[list[int], list[Entry]]] | None:
        """The decodes the requests' entries go in, in order: each the indices of its entries among all, and the
        (token, position, ids, wants logits) it decodes them as. None: one decode, as they come (EAGLE-3 may
        split)."""
        return None

    def decode(self, requests: Sequence[Sequence[Entry]]) -> list[list[int]]:
        flat = [e for entries in requests for e in entries]
        self.prepare_seconds = 0.0
        hidden = self._hidden(flat)
        passes = self._passes(requests)
        if passes is None:
            self.hidden_batch.fill([e[:4] for e in flat], hidden)
            seconds = self.hidden_batch.process()
            at: Sequence[int] = range(len(flat))
        else:
            seconds, at = 0.0, [0] * len(flat)  # each entry's row in the batch of its pass (the last one's count)
            for idx, rows in passes:
                self.hidden_batch.fill(rows, hidden[np.asarray(idx, dtype=np.intp)])
                seconds += self.hidden_batch.process()
                for row, i in enumerate(idx):
                    at[i] = row
        seconds += self.prepare_seconds  # with EAGLE-3's encoder, when it ran
        self.last_rows = n = len(flat)
        if n and all(e[3] for e in flat):
            self.live.observe(n, seconds)
        out, i = [], 0
        for entries in requests:
            out.append(list(at[i:i + len(entries)]))
            i += len(entries)
        return out


class MtpSequence(KvSequence):
    """One slot's share of the MTP context: a draft sequence whose rows carry the target's hidden states."""

    label = "mtp"

    def __init__(self, lane: MtpLane, stash: HiddenStash, base: int = 0, n_ids: int | None = None,
                 n_ctx: int | None = None) -> None:
        super().__init__(lane, base, n_ids, n_ctx)
        self.stash = stash
        self.paired = 0  # the leading cells decoded with the target's hidden states
        self.missing = 0  # rows decoded with zeros for want of the target's state (restored cells)
        self._last_hidden: np.ndarray | None = None  # the head's own hidden output at its last row
        # A tree's scratch sequences: the head's hidden output at each one's last row, which its next node is
        # paired with (a node's parent is the row before it on its sequence's path).
        self._tips: dict[int, np.ndarray] = {}

    def _catch_up(self, tokens: Sequence[int], start: int, stop: int) -> list[tuple]:
        """The rows (x_p, h_{p-1}) for positions start .. stop-1, each with the target's state, zeros where the
        stash has none."""
        out = []
        for p in range(start, stop):
            h = self.stash.get(p - 1, tokens[p - 1]) if p > 0 else None
            if h is None:
                h = self.stash.zeros()
                self.missing += p > 0
            out.append((tokens[p], p, (self.base,), False, h))
        return out

    def _reach(self, tokens: Sequence[int], keep: int) -> int:
        """How far a prefill from `keep` may decode `tokens`: as far as the target's states are at hand."""
        stop = keep
        while stop < len(tokens) and (stop == 0 or self.stash.get(stop - 1, tokens[stop - 1]) is not None):
            stop += 1
        return stop

    def _catch_up_span(self, tokens: Sequence[int], logits: bool) -> tuple[int, int]:
        """What `syncing(tokens, logits)` keeps of the head's paired cells (the rest are dropped here) and where
        its rows stop: the end, or with logits=False as far as the target's states are at hand."""
        keep = min(common_prefix(self.tokens, tokens), self.paired)
        if logits and keep == len(tokens):
            keep -= 1
        self.truncate(keep)
        stop = len(tokens) if logits else self._reach(tokens, keep)
        if stop > self.n_ctx:
            raise ContextFullError(f"{stop} tokens do not fit in the context of {self.n_ctx}")
        return keep, stop

    def syncing(self, tokens: Sequence[int], logits: bool = True) -> Generator[Decode, list[int], int]:
        """Make the head hold `tokens`, every row paired with the target's state; returns how many it kept.

        With logits=False (a prefill), it decodes only as far as the target's
        states are at hand: a prompt the target has not decoded yet is caught
        up at the next syncing, in the batch of the first draft row.
        """
        keep, stop = self._catch_up_span(tokens, logits)
        rows: list[int] = []
        for start in range(keep, stop, self.lane.chunk):
            end = min(stop, start + self.lane.chunk)
            entries = self._catch_up(tokens, start, end)
            if logits and end == stop and entries:
                entries[-1] = entries[-1][:3] + (True,) + entries[-1][4:]
            if entries:  # EAGLE-3 has no row for the first token
                rows = yield Decode(self.lane, entries)
            self.tokens.extend(tokens[start:end])
        self.paired = len(self.tokens)
        self.stash.drop_below(self.paired - KEEP_BEHIND)
        if logits and rows:
            self.rows, self.last_row = rows, rows[-1]
            self._last_hidden = hidden_row(self.ctx, self.last_row).copy()
        return keep

    def extending(self, tokens: Sequence[int], logits: str = "last") -> Rows:
        """Decode drafted `tokens` after what the head holds, the first paired with the head's own hidden output
        at its last row (a chain's next step); these rows are not paired with the target's states."""
        if not tokens:
            return []
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextFullError(f"{len(self.tokens) + len(tokens)} tokens do not fit in the context of "
                                   f"{self.n_ctx}")
        base = len(self.tokens)
        first = self._last_hidden if self._last_hidden is not None else self.stash.zeros()
        entries = [(tok, base + i, (self.base,), logits == "all" or (logits == "last" and i == len(tokens) - 1),
                    first if i == 0 else None) for i, tok in enumerate(tokens)]
        rows = yield Decode(self.lane, entries)
        self.tokens.extend(tokens)
        self.rows, self.last_row = rows, rows[-1]
        if logits != "none":
            self._last_hidden = hidden_row(self.ctx, self.last_row).copy()
        return rows

    def _tip(self, seq: int) -> np.ndarray | None:
        return self._last_hidden if seq == 0 else self._tips.get(seq)

    def decoding(self, entries: Iterable[tuple[int, int, Iterable[int], bool]]) -> Rows:
        """A tree's nodes after what the head holds, each on its own sequence and paired with the head's hidden
        output at that sequence's last row (its parent's), as EAGLE-2 feeds each node its parent's feature."""
        entries = [(tok, pos, tuple(seqs), want) for tok, pos, seqs, want in entries]
        rows = yield Decode(self.lane, [(tok, pos, self._ids(seqs), want, self._tip(seqs[0]))
                                        for tok, pos, seqs, want in entries])
        for (_, _, seqs, want), row in zip(entries, rows):
            if want:
                h = hidden_row(self.ctx, row).copy()
                for seq in seqs:
                    if seq == 0:
                        self._last_hidden = h
                    else:
                        self._tips[seq] = h
        return rows

    def fork(self, src: int, dst: int) -> None:
        super().fork(src, dst)
        tip = self._tip(src)
        if tip is not None:
            self._tips[dst] = tip

    def drop_seq(self, seq: int) -> None:
        super().drop_seq(seq)
        self._tips.pop(seq, None)

    def truncate(self, n: int) -> None:
        super().truncate(n)
        self.paired = min(self.paired, len(self.tokens))

    def save(self) -> bytearray:
        """The paired cells (drafted rows are dropped first: nobody would read them again)."""
        self.truncate(self.paired)
        return super().save()

    def restore(self, tokens: Sequence[int], state: bytearray) -> bool:
        ok = super().restore(tokens, state)
        self.paired = len(self.tokens)
        return ok

    def copy_prefix(self, src: KvSequence, n: int) -> None:
        super().copy_prefix(src, n)
        self.paired = min(n, getattr(src, "paired", 0))
        self.truncate(self.paired)

    def keep_branch(self, context: Sequence[int], keep: int, best_seq: int, reshare: int = 0) -> None:
        super().keep_branch(context, keep, best_seq, reshare)
        self.paired = min(self.paired, keep)

    def reset(self) -> None:
        super().reset()
        self.paired = 0
        self._last_hidden = None
        self._tips.clear()
        self.stash.clear()


def mtp_lanes(target: Lane, ctx: LlamaContext, ids: int, chunk: int | None, n_slots: int, n_ctx: int,
              lane: MtpLane | None = None, sequence: type[MtpSequence] = MtpSequence,
              ) -> tuple[MtpLane, list[MtpSequence]]:
    """The head's lane over `ctx` (the target model's MTP context; `lane` when given, a chained heads' one,
    backends.mtp_chain) and one `sequence` per slot, fed with the target lane's hidden rows from now on."""
    enable_hidden(target.ctx, masked=False)
    enable_hidden(ctx, masked=True)
    lane = lane or MtpLane(ctx, ids, chunk)
    stashes = [HiddenStash(i * ids, ids, ctx.model.n_embd, cap=max(256, n_ctx)) for i in range(n_slots)]
    target.followers.append(HiddenFeed(target.ctx, stashes))
    return lane, [sequence(lane, stashes[i], i * ids, ids, n_ctx) for i in range(n_slots)]
