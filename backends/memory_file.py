"""The speculation memory on disk: one file per vocabulary, appended to and never left half-written.

On disk (`MemoryFile`): a header (magic, format version, the vocabulary's
hash, its size) and then records, each a document: length, CRC-32, tokens.
Adding a document appends one record (flushed and fsynced off the decode
path, by a writer thread), so a crash or kill -9 can cut only the last
record, which the CRC finds and the next load drops; an append (under an
advisory lock: the chat app and a server may share the file) first trims a
cut record another process left at the end, and a write that fails midway
(a full disk) is truncated back, so that no record is ever cut in the
middle of the file. Past its bound
(`max_tokens`) the store evicts the documents used least recently and
rewrites the file whole (a temporary file renamed over it, so the old one
stays until the new one is complete). A file that is not a store, of another
vocabulary or corrupt is set aside (renamed `.bad`) with one line, and the
store starts empty. The file is readable by its owner only.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from models.files import write_atomic
from models.paths import data_dir

MAGIC = b"SPCSUFX1"
VERSION = 1
_HEADER = struct.Struct("<8sI32sI")  # magic, version, vocabulary hash (sha256), vocabulary size
_RECORD = struct.Struct("<II")  # tokens in the record, CRC-32 of their bytes

# In the data dir: the speculation memory, a file per vocabulary (the folder keeps the name it had before the
# memory had one name everywhere, so that memories written then are found).
MEMORY_DIR = "suffix"
# Where the memory lives instead; the second is its earlier name, still read.
MEMORY_ENV = ("SPECCHAT_MEMORY_DIR", "SPECCHAT_SUFFIX_CACHE")


def memory_dir(configured: Path | None) -> Path | None:
    """Where the speculation memory lives: as configured, else $SPECCHAT_MEMORY_DIR, else the data dir's
    `suffix/`; "" keeps none."""
    if configured is None:
        env = next((os.environ[name] for name in MEMORY_ENV if name in os.environ), None)
        configured = Path(env).expanduser() if env is not None else data_dir() / MEMORY_DIR
    return configured if str(configured) not in ("", ".") else None


MEMORY_PREFIX, MEMORY_SUFFIX = "memory-", ".bin"


def memory_file(folder: Path, vocab_hash: bytes) -> Path:
    return folder / f"{MEMORY_PREFIX}{vocab_hash.hex()[:16]}{MEMORY_SUFFIX}"


def memory_files(folder: Path) -> list[Path]:
    """The memory's files in `folder` (one per vocabulary), by name."""
    return sorted(folder.glob(f"{MEMORY_PREFIX}*{MEMORY_SUFFIX}")) if folder.is_dir() else []


class MemoryFileError(ValueError):
    """A store file that cannot be used (not a store, another vocabulary, corrupt): said in one line."""


class MemoryFile:
    """The store's file: header, then one record per document (see the module's docstring)."""

    def __init__(self, path: Path, vocab_hash: bytes, n_vocab: int) -> None:
        self.path = path
        self.vocab_hash = vocab_hash
        self.n_vocab = n_vocab

    def header(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.vocab_hash, self.n_vocab)

    def read(self) -> tuple[list[np.ndarray], bool]:
        """The documents, and whether a cut last record was dropped. Raises MemoryFileError for a file that is
        not this vocabulary's store."""
        docs, end = self._parse(self.path.read_bytes())
        return docs, end is not None

    def _parse(self, data: bytes) -> tuple[list[np.ndarray], int | None]:
        """The documents in `data`, and where a cut last record starts (None: the records are whole)."""
        if len(data) < _HEADER.size:
            raise MemoryFileError(f"{self.path}: too short to be a speculation memory file")
        magic, version, vocab_hash, n_vocab = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise MemoryFileError(f"{self.path}: not a speculation memory file")
        if version != VERSION:
            raise MemoryFileError(f"{self.path}: format {version}, this specchat reads {VERSION}")
        if vocab_hash != self.vocab_hash or n_vocab != self.n_vocab:
            raise MemoryFileError(f"{self.path}: written for another vocabulary")
        docs: list[np.ndarray] = []
        at = _HEADER.size
        while at < len(data):
            if at + _RECORD.size > len(data):
                return docs, at
            n, crc = _RECORD.unpack_from(data, at)
            body = data[at + _RECORD.size: at + _RECORD.size + 4 * n]
            if len(body) < 4 * n:
                return docs, at  # cut by a crash mid-write: the records before it are whole
            if zlib.crc32(body) != crc:
                if at + _RECORD.size + 4 * n >= len(data):
                    return docs, at
                raise MemoryFileError(f"{self.path}: a damaged record in the middle")
            doc = np.frombuffer(body, dtype="<u4").astype(np.int64)
            if doc.size and int(doc.max()) >= self.n_vocab:
                raise MemoryFileError(f"{self.path}: token ids outside the vocabulary")
            docs.append(doc)
            at += _RECORD.size + 4 * n
        return docs, None

    @staticmethod
    def record(doc: Sequence[int]) -> bytes:
        body = np.asarray(doc, dtype="<u4").tobytes()
        return _RECORD.pack(len(doc), zlib.crc32(body)) + body

    def append(self, docs: Sequence[Sequence[int]]) -> None:
        """The documents' records at the end of the file, whole or not at all (see the module)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            _lock(fd)
            size = os.fstat(fd).st_size
            if size >= _HEADER.size:  # a cut record another writer left at the end goes first
                with open(fd, "rb", closefd=False) as f:
                    f.seek(0)
                    try:
                        cut = self._parse(f.read())[1]
                    except MemoryFileError:  # damaged before its end: the next load sets it aside whole
                        cut = None
                if cut is not None:
                    os.ftruncate(fd, size := cut)
            elif size:  # a header cut short: the file starts anew
                os.ftruncate(fd, size := 0)
            data = (b"" if size else self.header()) + b"".join(self.record(d) for d in docs)
            try:
                view = memoryview(data)
                while view:  # os.write may write less than asked (a full disk, a signal)
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, size)  # nothing of it, rather than a record cut in the middle of the file
                raise
        finally:
            os.close(fd)  # (and the lock with it)

    def rewrite(self, docs: Sequence[Sequence[int]]) -> None:
        """The whole file anew: written beside it, synced, then renamed over it (the old one stays whole until
        then)."""
        write_atomic(self.path, self.header() + b"".join(self.record(d) for d in docs))

    def set_aside(self) -> Path:
        bad = self.path.with_name(self.path.name + f".bad-{int(time.time())}")
        os.replace(self.path, bad)
        return bad


def _lock(fd: int) -> None:
    """An advisory lock on the file until it is closed, where the system has one (fcntl: Linux, macOS)."""
    if sys.platform != "win32":
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)


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
    write_atomic(counters_path(store), json.dumps(counters))


def describe_file(path: Path) -> dict[str, object]:
    """What `specchat cache stats` shows of a store file, read without its model: documents, tokens, size and
    the kept counters; or the reason it cannot be read."""
    info: dict[str, object] = {"path": str(path), "file_bytes": path.stat().st_size}
    try:
        data = path.read_bytes()
        magic, version, vocab_hash, n_vocab = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise MemoryFileError("not a speculation memory file of this version")
        docs, cut = MemoryFile(path, vocab_hash, n_vocab).read()
    except (MemoryFileError, OSError, struct.error) as e:
        return {**info, "error": str(e)}
    c = read_counters(path)
    return {**info, "vocabulary": vocab_hash.hex()[:16], "n_vocab": n_vocab, "documents": len(docs),
            "tokens": int(sum(len(d) for d in docs)), "cut_record": cut, **c,
            "hit_rate": round(c.get("hits", 0) / c["lookups"], 4) if c.get("lookups") else None,
            "acceptance": round(c.get("accepted", 0) / c["proposed"], 4) if c.get("proposed") else None}
