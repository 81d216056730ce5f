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

On disk (`SuffixFile`): a header (magic, format version, the vocabulary's
hash, its size) and then records, each a document: length, CRC-32, tokens.
Adding a document appends one record (flushed and fsynced off the decode
path, by a writer thread), so a crash or kill -9 can cut only the last
record, which the CRC finds and the next load drops. Past its bound
(`max_tokens`) the store evicts the documents used least recently and
rewrites the file whole (a temporary file renamed over it, so the old one
stays until the new one is complete). A file that is not a store, of another
vocabulary or corrupt is set aside (renamed `.bad`) with one line, and the
store starts empty. The file is readable by its owner only.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from backends.config import SUFFIX_CACHE_TOKENS
from models.paths import data_dir

MAGIC = b"SPCSUFX1"
VERSION = 1
_HEADER = struct.Struct("<8sI32sI")  # magic, version, vocabulary hash (sha256), vocabulary size
_RECORD = struct.Struct("<II")  # tokens in the record, CRC-32 of their bytes
SEP = -1
BITS = 20  # token ids below 2^20 (1,048,576) fit three to an int64 key
DEFAULT_MAX_TOKENS = SUFFIX_CACHE_TOKENS
MIN_DOC = 8  # shorter documents teach nothing
CANDIDATES = 64  # most recent occurrences of the matched n-gram looked at
MATCH_MAX = 32  # match lengths counted up to this many tokens back
REBUILD_PENDING = 20_000  # tokens added since the last index build before it is rebuilt


SUFFIX_DIR = "suffix"  # in the data dir: the speculation memory, a file per vocabulary


def suffix_cache_dir(configured: Path | None) -> Path | None:
    """Where the speculation memory lives: as configured, else $SPECCHAT_SUFFIX_CACHE, else the data dir's
    `suffix/`; "" keeps none."""
    if configured is None:
        env = os.environ.get("SPECCHAT_SUFFIX_CACHE")
        configured = Path(env) if env is not None else data_dir() / SUFFIX_DIR
    return configured if str(configured) not in ("", ".") else None


def memory_file(folder: Path, vocab_hash: bytes) -> Path:
    return folder / f"memory-{vocab_hash.hex()[:16]}.bin"



class SuffixStoreError(ValueError):
    """A store file that cannot be used (not a store, another vocabulary, corrupt): said in one line."""


@dataclass
class Continuations:
    """Candidate continuations of the context: a token tree with each node's share of the occurrences.

    `parents[i]` is node i's parent (-1: a child of the root), parents come first; `probs[i]` the share of
    the weighed occurrences that continue through node i; `match` the longest match length behind them;
    `support` how many occurrences were merged.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0
    support: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def best_chain(self, limit: int) -> tuple[list[int], list[float]]:
        """The likeliest path from the root, up to `limit` tokens, with each node's share."""
        chain: list[int] = []
        probs: list[float] = []
        parent = -1
        while len(chain) < limit:
            kids = [i for i, p in enumerate(self.parents) if p == parent]
            if not kids:
                break
            best = max(kids, key=lambda i: self.probs[i])
            chain.append(self.tokens[best])
            probs.append(self.probs[best])
            parent = best
        return chain, probs

    def path(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(self.tokens[i])
            i = self.parents[i]
        return out[::-1]


def merge_continuations(sequences: Sequence[Sequence[int]], weights: Sequence[float], max_nodes: int,
                        match: int) -> Continuations:
    """A tree of the given continuations (each weighed), keeping the `max_nodes` nodes most occurrences pass."""
    total = float(sum(weights)) or 1.0
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    mass: list[float] = []
    for seq, w in zip(sequences, weights):
        parent = -1
        for t in seq:
            node = children.get((parent, t))
            if node is None:
                node = children[(parent, t)] = len(tokens)
                tokens.append(int(t))
                parents.append(parent)
                mass.append(0.0)
            mass[node] += w
            parent = node
    if len(tokens) > max_nodes:  # the heaviest nodes; a node's parent is at least as heavy, so it stays too
        keep = sorted(range(len(tokens)), key=lambda i: (-mass[i], i))[:max_nodes]
        kept = sorted(keep)
        remap = {old: new for new, old in enumerate(kept)}
        tokens = [tokens[i] for i in kept]
        parents = [remap.get(parents[i], -1) if parents[i] >= 0 else -1 for i in kept]
        mass = [mass[i] for i in kept]
    return Continuations(tokens, parents, [m / total for m in mass], match, len(sequences))


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


class SuffixFile:
    """The store's file: header, then one record per document (see the module's docstring)."""

    def __init__(self, path: Path, vocab_hash: bytes, n_vocab: int) -> None:
        self.path = path
        self.vocab_hash = vocab_hash
        self.n_vocab = n_vocab

    def header(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.vocab_hash, self.n_vocab)

    def read(self) -> tuple[list[np.ndarray], bool]:
        """The documents, and whether a cut last record was dropped. Raises SuffixStoreError for a file that is
        not this vocabulary's store."""
        data = self.path.read_bytes()
        if len(data) < _HEADER.size:
            raise SuffixStoreError(f"{self.path}: too short to be a speculation memory file")
        magic, version, vocab_hash, n_vocab = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise SuffixStoreError(f"{self.path}: not a speculation memory file")
        if version != VERSION:
            raise SuffixStoreError(f"{self.path}: format {version}, this specchat reads {VERSION}")
        if vocab_hash != self.vocab_hash or n_vocab != self.n_vocab:
            raise SuffixStoreError(f"{self.path}: written for another vocabulary")
        docs: list[np.ndarray] = []
        at = _HEADER.size
        while at < len(data):
            if at + _RECORD.size > len(data):
                return docs, True
            n, crc = _RECORD.unpack_from(data, at)
            body = data[at + _RECORD.size: at + _RECORD.size + 4 * n]
            if len(body) < 4 * n:
                return docs, True  # cut by a crash mid-write: the records before it are whole
            if zlib.crc32(body) != crc:
                if at + _RECORD.size + 4 * n >= len(data):
                    return docs, True
                raise SuffixStoreError(f"{self.path}: a damaged record in the middle")
            doc = np.frombuffer(body, dtype="<u4").astype(np.int64)
            if doc.size and int(doc.max()) >= self.n_vocab:
                raise SuffixStoreError(f"{self.path}: token ids outside the vocabulary")
            docs.append(doc)
            at += _RECORD.size + 4 * n
        return docs, False

    @staticmethod
    def record(doc: Sequence[int]) -> bytes:
        body = np.asarray(doc, dtype="<u4").tobytes()
        return _RECORD.pack(len(doc), zlib.crc32(body)) + body

    def append(self, docs: Sequence[Sequence[int]]) -> None:
        new = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if new or os.fstat(fd).st_size == 0:
                os.write(fd, self.header())
            os.write(fd, b"".join(self.record(d) for d in docs))
            os.fsync(fd)
        finally:
            os.close(fd)

    def rewrite(self, docs: Sequence[Sequence[int]]) -> None:
        """The whole file anew: written beside it, synced, then renamed over it (the old one stays whole until
        then)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, self.header() + b"".join(self.record(d) for d in docs))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def set_aside(self) -> Path:
        bad = self.path.with_name(self.path.name + f".bad-{int(time.time())}")
        os.replace(self.path, bad)
        return bad


class SuffixStore:
    """Earlier prompts and outputs of one vocabulary, and the continuations they suggest.

    Loaded on first use (a session that never looks pays nothing). `add` is
    called after each generation (from the decode thread; the file write
    happens on the store's writer thread). `warn` hears the one line about a
    file set aside.
    """

    def __init__(self, path: Path | None, vocab_hash: bytes, n_vocab: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                 warn: Callable[[str], None] = lambda _m: None) -> None:
        if max_tokens < 1000:
            raise ValueError("the speculation memory needs room for at least 1000 tokens")
        if n_vocab >= 1 << BITS:
            raise ValueError(f"vocabularies of {n_vocab} tokens are over the store's {1 << BITS}")
        self.file = SuffixFile(path, vocab_hash, n_vocab) if path is not None else None
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
            except (SuffixStoreError, OSError) as e:
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
                      extra: Sequence[tuple[Sequence[int], float]] = ()) -> Continuations:
        """What followed the longest suffix of `context` seen before, as a tree of at most `max_nodes` nodes
        and `max_depth` levels; `extra` adds continuations found elsewhere (the current request), weighed."""
        t0 = time.perf_counter()
        with self._lock:
            self._load()
            seqs, weights, match = self._candidates(context, max_depth)
        seqs += [list(s)[:max_depth] for s, _w in extra]
        weights += [w for _s, w in extra]
        self.lookups += 1
        if not seqs:
            self.lookup_seconds += time.perf_counter() - t0
            return Continuations()
        self.hits += 1
        out = merge_continuations(seqs, weights, max_nodes, match)
        self.lookup_seconds += time.perf_counter() - t0
        return out

    def _candidates(self, context: Sequence[int], depth: int) -> tuple[list[list[int]], list[float], int]:
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
            follow = ends[:, None] + 1 + np.arange(depth)[None, :]
            inside = follow < len(tokens)
            cont = np.where(inside, tokens[np.clip(follow, 0, len(tokens) - 1)], SEP)
            for row, length, end in zip(cont, lengths, ends):
                stop = np.flatnonzero(row < 0)
                row = row[: stop[0]] if len(stop) else row
                if len(row):
                    seqs.append(row.tolist())
                    weights.append(float(length))  # a longer match is likelier to go on the same way
                    best = max(best, int(length))
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


def counters_path(store: Path) -> Path:
    return store.with_name(store.name + ".stats.json")


def read_counters(store: Path) -> dict[str, int]:
    """The counters kept beside a store file (nothing, for a missing or unreadable one)."""
    try:
        data = json.loads(counters_path(store).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: int(v) for k, v in data.items() if isinstance(v, int) and v >= 0} if isinstance(data, dict) else {}


def write_counters(store: Path, counters: dict[str, int]) -> None:
    path = counters_path(store)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(counters).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def describe_file(path: Path) -> dict[str, object]:
    """What `specchat cache stats` shows of a store file, read without its model: documents, tokens, size and
    the kept counters; or the reason it cannot be read."""
    info: dict[str, object] = {"path": str(path), "file_bytes": path.stat().st_size}
    try:
        data = path.read_bytes()
        magic, version, vocab_hash, n_vocab = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise SuffixStoreError("not a speculation memory file of this version")
        docs, cut = SuffixFile(path, vocab_hash, n_vocab).read()
    except (SuffixStoreError, OSError, struct.error) as e:
        return {**info, "error": str(e)}
    c = read_counters(path)
    return {**info, "vocabulary": vocab_hash.hex()[:16], "n_vocab": n_vocab, "documents": len(docs),
            "tokens": int(sum(len(d) for d in docs)), "cut_record": cut, **c,
            "hit_rate": round(c.get("hits", 0) / c["lookups"], 4) if c.get("lookups") else None,
            "acceptance": round(c.get("accepted", 0) / c["proposed"], 4) if c.get("proposed") else None}
