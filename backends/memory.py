"""A speculation memory that persists: continuations of what models of this vocabulary wrote before.

After SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; vLLM's `suffix`
method): earlier prompts and outputs are kept, and at each step the text
that followed earlier occurrences of the current context's suffix is
proposed as a tree of candidate continuations, each node scored by how often
the earlier occurrences went that way. Unlike SuffixDecoding's in-memory
trees, the store lives on disk, per vocabulary (models that share a
tokenizer share it), so a restart remembers.

The index, for speed in Python: all kept documents are one token array
(documents separated by -1); for n = 1, 2, 3 the key of the n tokens ending
at each position (exact, not hashed: three token ids of at most 20 bits fit
in 60) is sorted with the positions, and a lookup is a binary search
(`np.searchsorted`). The candidates of the longest n that matches are the
most recent occurrences; how far each matches further back is measured at
once over all of them (the match length, as llama.cpp's lookup and
SuffixDecoding weigh a proposal by it), and the best ones' continuations
are merged into a tree whose node frequencies are the share of occurrences
through them. Documents added since the last index build are searched in a
small dict index until the next rebuild.

On disk: backends/memory_file.py (a file per vocabulary, appended to, never
left half-written).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from backends.config import MEMORY_TOKENS
from backends.memory_file import (MemoryFile, MemoryFileError, counters_path, read_counters,
                                   write_counters)
from backends.token_tree import EMPTY, TokenTree, TreeBuilder

SEP = -1
BITS = 20  # token ids below 2^20 (1,048,576) fit three to an int64 key
MIN_DOC = 8  # shorter documents teach nothing
CANDIDATES = 64  # most recent occurrences of the matched n-gram looked at
MATCH_MAX = 32  # match lengths counted up to this many tokens back
REBUILD_PENDING = 20_000  # tokens added since the last index build before it is rebuilt


@dataclass(frozen=True)
class Continuations:
    """Candidate continuations of the context: a token tree (backends.token_tree) whose weights are each node's
    share of the weighed occurrences that continue through it; `match` the longest match length behind them,
    `support` how many occurrences were merged."""

    tree: TokenTree = EMPTY
    match: int = 0
    support: int = 0

    def __post_init__(self) -> None:
        if self.match < 0 or self.support < 0:
            raise ValueError(f"a match length and a count are not negative, got {self.match} and {self.support}")

    def __len__(self) -> int:
        return len(self.tree)


def merge_continuations(sequences: Sequence[Sequence[int]], weights: Sequence[float], max_nodes: int,
                        match: int) -> Continuations:
    """A tree of the given continuations (each weighed), keeping the `max_nodes` nodes most occurrences pass."""
    total = float(sum(weights)) or 1.0
    merged = TreeBuilder()
    for seq, w in zip(sequences, weights):
        merged.add_path(seq, w)
    tree = merged.build()
    if len(tree) > max_nodes:  # the heaviest nodes; a node's parent is at least as heavy, so it stays too
        tree = tree.subset(sorted(range(len(tree)), key=lambda i: (-tree.weights[i], i))[:max_nodes])
    return Continuations(replace(tree, weights=tuple(m / total for m in tree.weights)), match, len(sequences))


class _Index:
    """Sorted n-gram keys (n = 1, 2, 3) of one token array, with the position of each n-gram's last token."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.keys: list[np.ndarray] = []
        self.positions: list[np.ndarray] = []
        t = tokens.astype(np.int64)
        valid = t >= 0
        key = np.zeros(len(t), dtype=np.int64)
        ok = np.ones(len(t), dtype=bool)
        for n in (1, 2, 3):
            if n == 1:
                key = t.copy()
                ok = valid.copy()
            else:
                key[n - 1:] = (key[n - 2:-1] << BITS) | np.maximum(t[n - 1:], 0)
                key[: n - 1] = 0
                ok[n - 1:] = ok[n - 2:-1] & valid[n - 1:]
                ok[: n - 1] = False
            pos = np.flatnonzero(ok)
            order = np.argsort(key[pos], kind="stable")  # positions ascending within a key: the last are newest
            self.keys.append(key[pos][order])
            self.positions.append(pos[order].astype(np.int64))

    def find(self, gram: Sequence[int]) -> np.ndarray:
        """Positions (ascending) of the last token of every occurrence of `gram` (1 to 3 tokens)."""
        n = len(gram)
        key = 0
        for tok in gram:
            key = (key << BITS) | int(tok)
        keys = self.keys[n - 1]
        lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
        return self.positions[n - 1][lo:hi]


class SpeculationMemory:
    """Earlier prompts and outputs of one vocabulary, and the continuations they suggest.

    Loaded on first use (a session that never looks pays nothing). `add` is
    called after each generation (from the decode thread; the file write
    happens on the store's writer thread). `warn` hears the one line about a
    file set aside.
    """

    def __init__(self, path: Path | None, vocab_hash: bytes, n_vocab: int, max_tokens: int = MEMORY_TOKENS,
                 warn: Callable[[str], None] = lambda _m: None) -> None:
        if max_tokens < 1000:
            raise ValueError("the speculation memory needs room for at least 1000 tokens")
        if n_vocab >= 1 << BITS:
            raise ValueError(f"vocabularies of {n_vocab} tokens are over the store's {1 << BITS}")
        self.file = MemoryFile(path, vocab_hash, n_vocab) if path is not None else None
        self.max_tokens = max_tokens
        self.warn = warn
        self._lock = threading.Lock()
        self._loaded = False
        self._docs: list[np.ndarray] = []
        self._used: list[int] = []  # per document: the clock when it was added or last proposed from
        self._seen: dict[int, int] = {}  # hash of a document's tokens -> its index (no duplicates)
        self._clock = 0
        self._index: _Index | None = None
        self._indexed_docs = 0  # documents in the built index; later ones are in `_recent`
        self._doc_of_pos: np.ndarray = np.zeros(0, dtype=np.int64)
        self._recent: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # trigram -> (doc, end position)
        self._pending_tokens = 0
        self._writes: queue.Queue[list[int] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self.lookups = 0
        self.hits = 0  # lookups that found a continuation
        self.proposed = 0
        self.accepted = 0
        self.lookup_seconds = 0.0
        self._earlier: dict[str, int] = {}  # the counters of earlier sessions (the stats file beside the store)
        self.frozen = False  # consulted but not updated (measurements that must not teach it as they go)

    # -- loading -------------------------------------------------------------

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        docs: list[np.ndarray] = []
        if self.file is not None and self.file.path.exists():
            try:
                docs, cut = self.file.read()
                if cut:  # a crash cut the last record: rewrite what is whole
                    self.file.rewrite(docs)
            except (MemoryFileError, OSError) as e:
                where = ""
                try:
                    where = f"; set aside as {self.file.set_aside().name}"
                except OSError:
                    pass
                self.warn(f"speculation memory: {e}{where}; starting a new one")
                docs = []
        for d in docs:
            self._keep(d)
        self._evict()
        self._rebuild()
        self._earlier = read_counters(self.file.path) if self.file is not None else {}

    def _keep(self, doc: np.ndarray) -> bool:
        key = hash(doc.tobytes())
        if key in self._seen:
            self._used[self._seen[key]] = self._tick()
            return False
        self._seen[key] = len(self._docs)
        self._docs.append(doc)
        self._used.append(self._tick())
        return True

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @property
    def n_tokens(self) -> int:
        return sum(len(d) for d in self._docs)

    def _evict(self) -> bool:
        """Drop the documents used least recently until the bound holds; whether any went."""
        total = self.n_tokens
        if total <= self.max_tokens:
            return False
        order = sorted(range(len(self._docs)), key=lambda i: self._used[i])
        drop = set()
        for i in order:
            if total <= self.max_tokens * 0.9:  # some headroom: not a rewrite per added document
                break
            drop.add(i)
            total -= len(self._docs[i])
        keep = [i for i in range(len(self._docs)) if i not in drop]
        self._docs = [self._docs[i] for i in keep]
        self._used = [self._used[i] for i in keep]
        self._seen = {hash(d.tobytes()): i for i, d in enumerate(self._docs)}
        return True

    def _rebuild(self) -> None:
        parts: list[np.ndarray] = []
        owners: list[np.ndarray] = []
        for i, d in enumerate(self._docs):
            parts += [d, np.array([SEP], dtype=np.int64)]
            owners += [np.full(len(d) + 1, i, dtype=np.int64)]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self._index = _Index(tokens)
        self._doc_of_pos = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)
        self._indexed_docs = len(self._docs)
        self._recent = {}
        self._pending_tokens = 0

    # -- adding -----------------------------------------------------------------

    def add(self, tokens: Sequence[int]) -> None:
        """Keep a document (the end of a prompt and its output), on disk too."""
        if len(tokens) < MIN_DOC or self.frozen:
            return
        doc = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            self._load()
            if not self._keep(doc):
                return
            if self._evict():
                self._rebuild()
                self._write(None)  # the whole file anew
                return
            i = len(self._docs) - 1
            for end in range(2, len(doc)):
                self._recent.setdefault(tuple(int(t) for t in doc[end - 2:end + 1]), []).append((i, end))
            self._pending_tokens += len(doc)
            if self._pending_tokens > REBUILD_PENDING:
                self._rebuild()
        self._write(list(doc))

    def _write(self, doc: list[int] | None) -> None:
        if self.file is None:
            return
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="specchat-memory", daemon=True)
            self._writer.start()
        self._writes.put(doc)

    def _write_loop(self) -> None:
        assert self.file is not None
        while True:
            doc = self._writes.get()
            batch = [doc]
            while not self._writes.empty():  # everything queued goes in one write
                batch.append(self._writes.get_nowait())
            try:
                if any(d is None for d in batch):
                    with self._lock:
                        docs = list(self._docs)
                    self.file.rewrite(docs)
                else:
                    self.file.append(batch)  # type: ignore[arg-type]
                write_counters(self.file.path, self.counters())
            except OSError as e:
                self.warn(f"speculation memory: cannot write {self.file.path}: {e.strerror}")
            finally:
                for _ in batch:
                    self._writes.task_done()

    def flush(self) -> None:
        """Wait until every document added is on disk."""
        if self._writer is not None and self._writer.is_alive():
            self._writes.join()

    def clear(self) -> None:
        with self._lock:
            self._loaded = True
            self._docs, self._used, self._seen = [], [], {}
            self._rebuild()
        self.flush()
        if self.file is not None:
            for path in (self.file.path, counters_path(self.file.path)):
                path.unlink(missing_ok=True)

    # -- looking up ---------------------------------------------------------------

    def continuations(self, context: Sequence[int], max_depth: int, max_nodes: int,
                      extra: Sequence[tuple[Sequence[int], float]] = (), min_match: int = 1) -> Continuations:
        """What followed the longest suffix of `context` seen before, as a tree of at most `max_nodes` nodes
        and `max_depth` levels; `extra` adds continuations found elsewhere (the current request), weighed.
        Only earlier occurrences that match at least `min_match` tokens back count (`auto` asks for a few:
        a short match proposes text that seldom goes on the same way, and costs the step its lookup)."""
        if max_depth < 1:  # no room left to propose anything
            return Continuations()
        t0 = time.perf_counter()
        with self._lock:
            self._load()
            seqs, weights, match = self._candidates(context, max_depth, min_match)
        self.lookups += 1
        self.hits += bool(seqs)  # the memory's own: what the request adds is no hit of the memory's
        seqs += [list(s)[:max_depth] for s, _w in extra]
        weights += [w for _s, w in extra]
        if not seqs:
            self.lookup_seconds += time.perf_counter() - t0
            return Continuations()
        out = merge_continuations(seqs, weights, max_nodes, match)
        self.lookup_seconds += time.perf_counter() - t0
        return out

    def _candidates(self, context: Sequence[int], depth: int,
                    min_match: int = 1) -> tuple[list[list[int]], list[float], int]:
        index = self._index
        if index is None or len(context) < 1:
            return [], [], 0
        tail = [int(t) for t in context[-3:]]
        for n in range(min(3, len(tail)), 0, -1):
            gram = tail[-n:]
            ends = index.find(gram)[-CANDIDATES:]
            recent = self._recent.get(tuple(gram), []) if n == 3 else []
            if len(ends) or recent:
                break
        else:
            return [], [], 0
        if n < min(min_match, 3):  # no longer n-gram occurs, so no match can reach back min_match tokens
            return [], [], 0
        tokens = index.tokens
        seqs: list[list[int]] = []
        weights: list[float] = []
        best = 0
        ctx = np.asarray(context[-(MATCH_MAX + n):], dtype=np.int64)
        if len(ends):
            # How far each occurrence matches further back, all at once.
            back = np.arange(1, MATCH_MAX + 1)
            idx = ends[:, None] - n + 1 - back[None, :]
            ok = idx >= 0
            prev = np.where(ok, tokens[np.clip(idx, 0, None)], SEP)
            want = np.full(MATCH_MAX, -2, dtype=np.int64)
            avail = min(MATCH_MAX, len(ctx) - n)
            if avail > 0:
                want[:avail] = ctx[-n - 1::-1][:avail]
            same = np.cumprod(prev == want[None, :], axis=1)
            lengths = n + same.sum(axis=1)
            if min_match > n:
                keep_ends = lengths >= min_match
                ends, lengths = ends[keep_ends], lengths[keep_ends]
            follow = ends[:, None] + 1 + np.arange(depth)[None, :]
            inside = follow < len(tokens)
            cont = np.where(inside, tokens[np.clip(follow, 0, len(tokens) - 1)], SEP)
            stops = np.where((cont < 0).any(axis=1), (cont < 0).argmax(axis=1), depth)  # a row ends at its doc's end
            for row, stop, length, end in zip(cont.tolist(), stops.tolist(), lengths.tolist(), ends.tolist()):
                if stop:
                    seqs.append(row[:stop])
                    weights.append(float(length))  # a longer match is likelier to go on the same way
                    best = max(best, length)
                    self._used[int(self._doc_of_pos[end])] = self._tick()
        tail = [int(t) for t in ctx[::-1]]  # the context backwards, from its last token
        for doc, end in recent[-CANDIDATES:]:
            d = self._docs[doc]
            row = d[end + 1:end + 1 + depth]
            if not len(row):
                continue
            length = n
            while length < n + MATCH_MAX and end - length >= 0 and length < len(tail) \
                    and int(d[end - length]) == tail[length]:
                length += 1
            if length < min_match:
                continue
            seqs.append(row.tolist())
            weights.append(float(length))
            best = max(best, length)
            self._used[doc] = self._tick()
        # The occurrences that match about as far back as the best one: a continuation after a 3-token match
        # says little beside one after a 20-token match of the same context.
        keep = [i for i, w in enumerate(weights) if w >= max(n, best / 2)]
        return [seqs[i] for i in keep], [weights[i] for i in keep], best

    def counters(self) -> dict[str, int]:
        """Lookups, hits, proposed and accepted tokens, this session's added to the earlier ones'."""
        now = {"lookups": self.lookups, "hits": self.hits, "proposed": self.proposed, "accepted": self.accepted}
        return {k: v + int(self._earlier.get(k, 0)) for k, v in now.items()}

    def record(self, proposed: int, accepted: int) -> None:
        """What became of a proposal from the memory (for `specchat cache stats`)."""
        self.proposed += proposed
        self.accepted += accepted

    def stats(self) -> dict[str, object]:
        with self._lock:
            self._load()
            size = self.file.path.stat().st_size if self.file is not None and self.file.path.exists() else 0
            c = self.counters()
            return {"documents": len(self._docs), "tokens": self.n_tokens, "max_tokens": self.max_tokens,
                    "file_bytes": size, "path": str(self.file.path) if self.file else None, **c,
                    "hit_rate": round(c["hits"] / c["lookups"], 4) if c["lookups"] else 0.0,
                    "acceptance": round(c["accepted"] / c["proposed"], 4) if c["proposed"] else 0.0,
                    "lookup_ms": round(1e3 * self.lookup_seconds / self.lookups, 4) if self.lookups else 0.0}


