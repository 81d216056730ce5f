"""The tokens a context's KV cache holds, kept in step with llama.cpp.

One mechanism serves prefill, multi-turn reuse and speculative rollback:
`sync(tokens)` keeps the longest common prefix already in the cache, removes
the rest (`llama_memory_seq_rm`) and decodes only what is missing. Rollback
refuses loudly when llama.cpp cannot remove part of a sequence (recurrent
models, or a sliding-window cache without `swa_full`), because continuing
would decode on a corrupt cache.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from backends.errors import CacheRollbackError, ContextFullError
from backends.llama import Batch, LlamaContext


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KvSequence:
    """Sequence 0 of a context (the main branch; other sequence ids are scratch space)."""

    def __init__(self, ctx: LlamaContext) -> None:
        self.ctx = ctx
        self.tokens: list[int] = []
        self.batch = Batch(ctx.n_batch, ctx.config.n_seq_max)
        # Batch row whose logits belong to the last decoded token.
        self.last_row = -1

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    @property
    def model(self):
        return self.ctx.model

    @property
    def n_seq_max(self) -> int:
        """Sequence ids this context allows (0 is the main branch, the others scratch space)."""
        return self.ctx.config.n_seq_max

    @property
    def n_vocab(self) -> int:
        return self.ctx.n_vocab

    @property
    def batch_capacity(self) -> int:
        return self.batch.capacity

    # -- several sequences: branches of a tree, lookahead's window and n-grams -------------------

    def decode_rows(self, entries: Iterable[tuple[int, int, Iterable[int], bool]]) -> list[int]:
        """Decode one batch of (token, position, sequence ids, wants logits) after what the cache holds.

        Returns each entry's batch row, to read its logits with `logits(row)`.
        The cells go to the given sequences; `tokens` (sequence 0's record) is
        not changed: the caller keeps a branch afterwards (`keep_branch`).
        """
        self.batch.clear()
        rows = [self.batch.add(tok, pos, seqs, want) for tok, pos, seqs, want in entries]
        self.ctx.decode(self.batch)
        return rows

    def fork(self, src: int, dst: int) -> None:
        """Sequence `dst` holds exactly the cells of `src` (a unified cache shares them, no copy)."""
        self.ctx.seq_rm(dst, -1, -1)
        self.ctx.seq_cp(src, dst, -1, -1)

    def drop_seq(self, seq: int) -> None:
        """Remove every cell of scratch sequence `seq` (never 0: use truncate for the main branch)."""
        assert seq != 0, "sequence 0 is the main branch"
        self.ctx.seq_rm(seq, -1, -1)

    def keep_branch(self, context: Sequence[int], keep: int, best_seq: int, reshare: int = 0) -> None:
        """Keep the first `keep` positions; the cells of `best_seq` (0: none won) become sequence 0.

        Every other sequence's cells go; with `reshare` > 1, sequences
        1..reshare-1 then share sequence 0's cells again. `context` is what
        sequence 0 holds afterwards (its first `keep` tokens).
        """
        self.drop_cells_from(keep)
        if best_seq != 0:
            self.ctx.seq_keep(best_seq)
            self.ctx.seq_cp(best_seq, 0, -1, -1)
            self.ctx.seq_rm(best_seq, -1, -1)
            self.share_with(reshare)
        self.tokens = list(context[:keep])

    def truncate(self, n: int) -> None:
        """Forget the tokens from position n on (their cells in every sequence go too)."""
        if n >= len(self.tokens):
            return
        self.drop_cells_from(n)
        del self.tokens[n:]

    def drop_cells_from(self, pos: int) -> None:
        """Remove every cell at position >= pos, in all sequences; refuse loudly if llama.cpp cannot.

        Some caches report success yet drop more: a sliding-window cache past its
        window (without swa_full) clears the whole sequence. So the cells below
        pos that sequence 0 should still hold are checked too.
        """
        expected_last = min(pos, len(self.tokens)) - 1
        if not self.ctx.seq_rm(-1, pos, -1) or self.ctx.pos_max(0) < expected_last:
            self.tokens.clear()
            self.ctx.clear()
            raise CacheRollbackError(
                "llama.cpp cannot remove part of this model's KV cache (recurrent or sliding-window "
                "memory), so speculative decoding cannot run on it; use -s ar"
            )

    def extend(self, tokens: Sequence[int], logits: str = "last") -> None:
        """Decode `tokens` after what is cached. logits: 'last', 'all' (one batch) or 'none'.

        With 'all', row i holds the logits after tokens[i]; with 'last', `last_row` does.
        """
        if not tokens:
            return
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextFullError(
                f"{len(self.tokens) + len(tokens)} tokens do not fit in the context of {self.n_ctx}"
            )
        step = self.batch.capacity
        if logits == "all" and len(tokens) > step:
            raise ValueError(f"cannot return logits for {len(tokens)} tokens in one batch of {step}")
        for start in range(0, len(tokens), step):
            chunk = tokens[start : start + step]
            final = start + step >= len(tokens)
            self.batch.clear()
            base = len(self.tokens)
            for i, tok in enumerate(chunk):
                want = logits == "all" or (logits == "last" and final and i == len(chunk) - 1)
                self.batch.add(tok, base + i, (0,), want)
            self.ctx.decode(self.batch)
            self.tokens.extend(chunk)
        self.last_row = len(tokens) - 1 if logits == "all" else len(self.batch) - 1

    def sync(self, tokens: Sequence[int], logits: bool = True) -> int:
        """Make the cache hold exactly `tokens`; returns how many were already cached.

        With logits=True the last token is decoded anew if it was cached, so that
        its logits are at `last_row`.
        """
        keep = common_prefix(self.tokens, tokens)
        if logits and keep == len(tokens):
            keep -= 1
        self.truncate(keep)
        self.extend(tokens[keep:], "last" if logits else "none")
        return keep

    def share_with(self, n_seqs: int) -> None:
        """Make sequences 1..n_seqs-1 hold exactly sequence 0's cells (a unified cache shares them, no copy)."""
        for seq in range(1, n_seqs):
            self.fork(0, seq)

    def logits(self, row: int | None = None):
        return self.ctx.logits(self.last_row if row is None else row)

    def reset(self) -> None:
        self.tokens.clear()
        self.ctx.clear()
