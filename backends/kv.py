"""The tokens a sequence's KV cache holds, kept in step with llama.cpp, for one or many sequences per context.

One mechanism serves prefill, multi-turn reuse and speculative rollback:
`sync(tokens)` keeps the longest common prefix already in the cache, removes
the rest (`llama_memory_seq_rm`) and decodes only what is missing. Where
llama.cpp cannot remove part of a sequence (a recurrent state past its last
n_rs_seq snapshots, a sliding-window cache without `swa_full`), `sync`
decodes the whole prompt again, and speculative rollback refuses loudly,
because continuing would decode on a corrupt cache.

Many sequences share one context (continuous batching, backends.scheduler):
a `Lane` is a context with the one batch every decode on it is packed into,
and each `KvSequence` is a view of it that owns a range of sequence ids
(`base` .. `base + n_ids - 1`, as llama-server gives each slot its own). A
strategy speaks in local ids (0 is its main branch, 1.. its scratch branches
for trees and lookahead's window); the view translates them, so the same
batch layouts run alone or beside other sequences, and removing or keeping
cells never touches another sequence's ids.

Decoding comes in two forms. `decoding`, `extending` and `syncing` are step
machines' coroutines (backends.steps): they *yield* a `Decode` (rows to
decode) and receive the batch rows they landed on, so that a scheduler can
pack the rows of many sequences into one `llama_decode` (backends.scheduler).
`decode_rows`, `extend` and `sync` run the same code and decode at once
(backends.steps.run_now): for measurements, tests and tools that hold the
context alone.
"""

from __future__ import annotations

import time
from typing import Callable, Generator, Iterable, Sequence

from backends.errors import CacheRollbackError, ContextFullError
from backends.live_cost import LiveCurve
from backends.llama import Batch, LlamaContext
from backends.steps import Decode, Entry, Rows, run_now
from backends.thread_count import FollowingCount, ThreadCount


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from the start. By halving with list comparisons (C loops), not token by
    token in Python: it runs on every draft step (`KvSequence.syncing`) over the whole conversation."""
    n = min(len(a), len(b))
    a, b = list(a[:n]), list(b[:n])
    if a == b:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Lane:
    """One llama.cpp context and the batch its decodes are packed into.

    `chunk` is the most prompt tokens one sequence puts in a batch: the whole
    batch when it decodes alone, less when it shares the batch with others
    (a long prompt then delays the others' next tokens by one chunk at most).
    `live` is its cost curve, kept current from every decode whose rows all
    want logits (backends.live_cost): what speculation is priced with.
    `followers` are called after every decode with its requests and rows,
    while the context's outputs are at hand (backends.mtp reads the target's
    hidden states so).
    """

    def __init__(self, ctx: LlamaContext, ids_per_token: int | None = None, chunk: int | None = None) -> None:
        self.ctx = ctx
        self.batch = Batch(ctx.n_batch, ids_per_token or ctx.config.n_seq_max)
        self.chunk = min(chunk or ctx.n_batch, ctx.n_batch)
        self.live = LiveCurve()
        self.last_rows = 0  # rows of the last decode
        self.seconds = 0.0  # in llama_decode, all decodes together (a tick's decode time is the difference)
        self.followers: list[Callable[[Sequence[Sequence[Entry]], list[list[int]]], None]] = []
        # The thread count that decodes fastest now, up to the context's (backends.thread_count), or the one another
        # lane found (a draft's, its target's); None: always the context's (layers offloaded, or one thread).
        self.threads: ThreadCount | FollowingCount | None = None

    @property
    def capacity(self) -> int:
        return self.batch.capacity

    def decode(self, requests: Sequence[Sequence[Entry]]) -> list[list[int]]:
        """Decode the entries of several requests in one batch; each request's batch rows, in order."""
        self.batch.clear()
        rows = [[self.batch.add(tok, pos, seqs, want) for tok, pos, seqs, want in entries] for entries in requests]
        n = sum(map(len, requests))
        count = self.threads
        threads = self.ctx.threads if count is None else self.ctx.set_threads(count.next(n))
        t0 = time.perf_counter()
        self.ctx.decode(self.batch)
        seconds = time.perf_counter() - t0
        self.last_rows = n
        self.seconds += seconds
        probe = count is not None and threads != count.current  # a few decodes at another count
        if count is not None:
            count.observe(threads, n, seconds)
        if not probe and all(e[3] for entries in requests for e in entries):  # not a prompt chunk: a shape
            self.live.observe(n, seconds)  # speculation prices
        for follow in self.followers:
            follow(requests, rows)
        return rows


class KvSequence:
    """One sequence's share of a lane: its sequence ids, the tokens its main branch holds, its last rows."""

    label = "draft"  # what a drafter on this sequence is called (Token.source): a draft model's
    # The longest chain one `syncing` gives, for a drafter that proposes a whole block from one decode
    # (backends.dflash); None: one decode per drafted token, as long as a strategy asks.
    chain_max: int | None = None
    # The deepest a chain or a tree's path may be drafted, one decode per token as usual (a model's chained MTP
    # heads: one head per draft position, backends.mtp_chain); None: as deep as a strategy asks.
    depth_max: int | None = None
    # Whether the cells its context answers for are its own. False for a drafter whose context was made with
    # ctx_other and reads the target's cells (Gemma 4's assistant, backends.gemma4_assistant): its `cells()` are
    # the slot's target's, so whatever counts, saves or checks a slot's cells counts such a sequence zero times,
    # and the engine has it `follow` its slot's target sequence.
    owns_cells: bool = True

    def __init__(self, lane: Lane | LlamaContext, base: int = 0, n_ids: int | None = None,
                 n_ctx: int | None = None) -> None:
        self.lane = lane if isinstance(lane, Lane) else Lane(lane)
        self.ctx = self.lane.ctx
        self.base = base
        self.n_ids = n_ids or self.ctx.config.n_seq_max - base
        # Alone in its context, "every sequence" is llama.cpp's -1: one pass over the cells instead of one per id.
        self.alone = base == 0 and self.n_ids >= self.ctx.config.n_seq_max
        self._n_ctx = n_ctx or self.ctx.n_ctx
        self.tokens: list[int] = []
        # Batch rows of the last decode: `rows[i]` holds the logits after the i-th token of an `extend`.
        self.rows: list[int] = []
        self.last_row = -1
        self._hi = 1  # local ids that may hold cells are below this

    def max_depth(self, k: int) -> int:
        """The deepest of `k` positions a chain or a tree's path may be drafted here (`depth_max`)."""
        return k if self.depth_max is None else min(k, self.depth_max)

    @property
    def n_ctx(self) -> int:
        """Positions this sequence may fill (its share of the context)."""
        return self._n_ctx

    @property
    def model(self):
        return self.ctx.model

    @property
    def n_seq_max(self) -> int:
        """Sequence ids this sequence owns (0 is the main branch, the others scratch space)."""
        return self.n_ids

    @property
    def n_vocab(self) -> int:
        return self.ctx.n_vocab

    @property
    def batch(self) -> Batch:
        return self.lane.batch

    @property
    def batch_capacity(self) -> int:
        return self.lane.capacity

    def _ids(self, seqs: Iterable[int]) -> tuple[int, ...]:
        out = tuple(self.base + s for s in seqs)
        if out:
            top = out[-1] if len(out) == 1 else max(out)
            if top - self.base >= self._hi:
                if top - self.base >= self.n_ids:
                    raise ValueError(f"sequence id {top - self.base} is beyond the {self.n_ids} this sequence owns")
                self._hi = top - self.base + 1
        return out

    # -- decoding: coroutines (yield a Decode) and their immediate forms ----------------------------

    def decoding(self, entries: Iterable[tuple[int, int, Iterable[int], bool]]) -> Rows:
        """Decode one batch of (token, position, local sequence ids, wants logits) after what the cache holds.

        Returns each entry's batch row, to read its logits with `logits(row)`.
        The cells go to the given sequences; `tokens` (the main branch's
        record) is not changed: the caller keeps a branch afterwards (`keep_branch`).
        """
        rows = yield Decode(self.lane, [(tok, pos, self._ids(seqs), want) for tok, pos, seqs, want in entries])
        return rows

    def extending(self, tokens: Sequence[int], logits: str = "last") -> Rows:
        """Decode `tokens` after what is cached. logits: 'last', 'all' (one batch) or 'none'.

        With 'all', `rows[i]` holds the logits after tokens[i]; with 'last', `last_row` does.
        A long run without 'all' is decoded in chunks of the lane's `chunk` tokens.
        """
        if not tokens:
            return []
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextFullError(
                f"{len(self.tokens) + len(tokens)} tokens do not fit in the context of {self.n_ctx}"
            )
        step = self.lane.capacity if logits == "all" else self.lane.chunk
        if logits == "all" and len(tokens) > step:
            raise ValueError(f"cannot return logits for {len(tokens)} tokens in one batch of {step}")
        seq = (self.base,)
        rows: list[int] = []
        for start in range(0, len(tokens), step):
            chunk = tokens[start : start + step]
            final = start + step >= len(tokens)
            base = len(self.tokens)
            entries = [(tok, base + i, seq,
                        logits == "all" or (logits == "last" and final and i == len(chunk) - 1))
                       for i, tok in enumerate(chunk)]
            rows = yield Decode(self.lane, entries)
            self.tokens.extend(chunk)
        self.rows = rows
        self.last_row = rows[-1]
        return rows

    def syncing(self, tokens: Sequence[int], logits: bool = True) -> Generator[Decode, list[int], int]:
        """Make the cache hold exactly `tokens`; returns how many were already cached.

        With logits=True the last token is decoded anew if it was cached, so that
        its logits are at `last_row`.
        """
        keep = common_prefix(self.tokens, tokens)
        if logits and keep == len(tokens):
            keep -= 1
        keep = self.cut(keep)
        yield from self.extending(tokens[keep:], "last" if logits else "none")
        return keep

    def plan(self, k: int) -> None:
        """The chain drafted after the next `syncing` takes at most k tokens: a block drafter decodes that many
        at once (backends.dflash, as llama-server sizes its block from --spec-draft-n-max); others need not know."""

    def decode_rows(self, entries: Iterable[tuple[int, int, Iterable[int], bool]]) -> list[int]:
        """`decoding`, at once."""
        return run_now(self.decoding(entries))  # type: ignore[return-value]

    def extend(self, tokens: Sequence[int], logits: str = "last") -> None:
        """`extending`, at once."""
        run_now(self.extending(tokens, logits))

    def sync(self, tokens: Sequence[int], logits: bool = True) -> int:
        """`syncing`, at once."""
        return run_now(self.syncing(tokens, logits))  # type: ignore[return-value]

    def logits(self, row: int | None = None):
        """Logits of batch row `row` of the lane's last decode (default: this sequence's last token's)."""
        return self.ctx.logits(self.last_row if row is None else row)

    # -- cells: no decoding ------------------------------------------------------------------------

    def fork(self, src: int, dst: int) -> None:
        """Sequence `dst` holds exactly the cells of `src` (a unified cache shares them, no copy)."""
        src_id, dst_id = self._ids((src, dst))
        self.ctx.seq_rm(dst_id, -1, -1)
        self.ctx.seq_cp(src_id, dst_id, -1, -1)

    def drop_seq(self, seq: int) -> None:
        """Remove every cell of scratch sequence `seq` (never 0: use truncate for the main branch)."""
        assert seq != 0, "sequence 0 is the main branch"
        self.ctx.seq_rm(self.base + seq, -1, -1)

    def keep_branch(self, context: Sequence[int], keep: int, best_seq: int, reshare: int = 0) -> None:
        """Keep the first `keep` positions; the cells of `best_seq` (0: none won) become sequence 0.

        Every other sequence's cells go; with `reshare` > 1, sequences
        1..reshare-1 then share sequence 0's cells again. `context` is what
        sequence 0 holds afterwards (its first `keep` tokens).
        """
        self.drop_cells_from(keep)
        if best_seq != 0:
            best = self.base + best_seq
            if self.alone:
                self.ctx.seq_keep(best)
            else:  # llama_memory_seq_keep would drop the other sequences' cells too
                for s in range(self._hi):
                    if s != best_seq:
                        self.ctx.seq_rm(self.base + s, -1, -1)
            self.ctx.seq_cp(best, self.base, -1, -1)
            self.ctx.seq_rm(best, -1, -1)
            self.share_with(reshare)
        self.tokens = list(context[:keep])

    def truncate(self, n: int) -> None:
        """Forget the tokens from position n on (their cells in every sequence go too)."""
        if n >= len(self.tokens):
            return
        self.drop_cells_from(n)
        del self.tokens[n:]

    def cut(self, n: int) -> int:
        """Forget the tokens from position n on where llama.cpp can cut there, else everything (a recurrent
        state keeps no history but its last few snapshots, llama.cpp's n_rs_seq; a sliding window without
        swa_full forgets the start): how many tokens are kept. For a prefix that is decoded again anyway."""
        if n >= len(self.tokens):
            return len(self.tokens)
        if self._rm_from(n) and self.ctx.pos_max(self.base) >= n - 1:
            del self.tokens[n:]
            return n
        self.reset()
        return 0

    def _rm_from(self, pos: int) -> bool:
        if self.alone and self._hi > 1:  # -1: every id in one pass (a recurrent state is cut only by its own id)
            return self.ctx.seq_rm(-1, pos, -1)
        ok = True
        for s in range(self._hi):
            ok = self.ctx.seq_rm(self.base + s, pos, -1) and ok
        return ok

    def drop_cells_from(self, pos: int) -> None:
        """Remove every cell at position >= pos, in all of this sequence's ids; refuse loudly if llama.cpp cannot.

        Some caches report success yet drop more: a sliding-window cache past its
        window (without swa_full) clears the whole sequence. So the cells below
        pos that sequence 0 should still hold are checked too.
        """
        expected_last = min(pos, len(self.tokens)) - 1
        if not self._rm_from(pos) or self.ctx.pos_max(self.base) < expected_last:
            self.reset()
            raise CacheRollbackError(
                "llama.cpp cannot remove part of this model's KV cache (recurrent or sliding-window "
                "memory), so speculative decoding cannot run on it; use -s ar"
            )

    def share_with(self, n_seqs: int) -> None:
        """Make sequences 1..n_seqs-1 hold exactly sequence 0's cells (a unified cache shares them, no copy)."""
        for seq in range(1, n_seqs):
            self.fork(0, seq)

    def copy_prefix(self, src: "KvSequence", n: int) -> None:
        """Hold exactly the first `n` tokens of `src`'s main branch, sharing its cells (a unified cache copies
        nothing): the choices of one request start from the prompt one of them decoded."""
        assert src.ctx is self.ctx and n <= len(src.tokens)
        self.reset()
        if n > 0:
            self.ctx.seq_cp(src.base, self.base, 0, n)
            self.tokens = list(src.tokens[:n])

    def save(self) -> bytearray:
        """The main branch's cells, to `restore` later in this or another sequence of the same context."""
        return self.ctx.seq_state(self.base)

    def restore(self, tokens: Sequence[int], state: bytearray) -> bool:
        """Hold exactly `tokens` from a `save` of them (what this sequence held goes); False when llama.cpp
        could not restore them (the sequence is then empty)."""
        self.reset()
        if self.ctx.seq_restore(self.base, state) and self.cells() == len(tokens):
            self.tokens = list(tokens)
            return True
        self.reset()
        return False

    def reset(self) -> None:
        """Forget everything this sequence holds (another sequence's cells stay)."""
        self.tokens.clear()
        if self.alone:
            self.ctx.clear()
        else:
            for s in range(self.n_ids):
                self.ctx.seq_rm(self.base + s, -1, -1)
        self._hi = 1

    def cells(self) -> int:
        """Cells this sequence's main branch holds in llama.cpp (its last position + 1)."""
        return self.ctx.pos_max(self.base) + 1

    def follow(self, target: "KvSequence") -> None:
        """Take `target` (its slot's target sequence) as the one whose cells it reads: for a sequence that owns
        none (`owns_cells` False); one that owns its cells has nothing to do."""
