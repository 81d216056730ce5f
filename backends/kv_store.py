"""Conversations that resume at once: a sequence's KV cells kept on disk, for later processes.

On a laptop, reading a long prompt is the slow part (a CPU decodes a small
model's prompt at a few hundred tokens per second), and everything the RAM
caches hold (backends.prompt_cache, the chat app's cache across turns) is
lost when the process ends. llama.cpp saves a sequence's cells with
`llama_state_seq_get_data` (what the RAM cache keeps too); this keeps them in
files, as llama-cli's `--prompt-cache` and llama-server's `--slot-save-path`
do, with what makes a file safe to load again:

- `KvKey`: what the cells depend on: the model files (path, size,
  modification time; the draft's too), the context a sequence has, the
  llama.cpp build (the state's layout is its own). A file written under
  another key is refused, not loaded.
- A file (`write_entry`/`read_entry`): a header line of JSON (the key, the
  tokens each cache holds, the blobs' sizes), then the target's and the
  draft's blobs. Written atomically, readable by its owner only
  (models.files.write_atomic); a truncated or corrupted file does not parse
  and is refused with one line (`KvStoreError`).
- `restore` / `snapshot`: a slot's target and draft sequences from and to
  an entry. The draft's cells are optional (a strategy without a draft, or
  a draft that had not caught up): whatever a cache lacks it decodes.

- `KvDiskStore`: a folder of entries found by the longest prefix of a
  prompt, bounded in bytes (least recently used out), written off the
  decoding thread: the chat app keeps each conversation's cells after every
  turn there, so that reopening it (F5, another day) decodes only what is new.

The restored cells are the ones decoding the same tokens would have made, so
every strategy's output after a restore is token for token what it is after
decoding the prompt at temperature 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from backends.device_cost import file_identity
from models.files import write_atomic

if TYPE_CHECKING:
    from backends.kv import KvSequence

MAGIC = "specchat-kv/1"


class KvStoreError(ValueError):
    """A KV file that cannot be used here: another model or context, or not a whole file."""


class NotKvFile(KvStoreError):
    """A file that is no specchat KV file at all (or cannot be read): not ours to replace."""


@dataclass(frozen=True)
class KvKey:
    """What a sequence's cells depend on, as JSON data (compared whole)."""

    target: tuple
    draft: tuple
    n_ctx: int
    build: str

    @classmethod
    def of(cls, target: Path, draft: Path | None, n_ctx: int, build: str) -> "KvKey":
        return cls(tuple(file_identity(target)), tuple(file_identity(draft)), n_ctx, build)

    def as_json(self) -> dict:
        return {"target": list(self.target), "draft": list(self.draft), "n_ctx": self.n_ctx, "build": self.build}

    def differs(self, data: object) -> str | None:
        """Why a file's key is not this one (in words), or None when it is."""
        if not isinstance(data, dict):
            return "it has no key"
        mine = self.as_json()
        for name, what in (("target", "another target model file"), ("draft", "another draft model file"),
                           ("n_ctx", "another context size"), ("build", "another llama.cpp build")):
            if data.get(name) != mine[name]:
                return f"it was written for {what}"
        return None


@dataclass(frozen=True)
class KvEntry:
    """The tokens each cache holds and its cells (the draft's may be absent)."""

    target_tokens: tuple[int, ...]
    target_state: bytes
    draft_tokens: tuple[int, ...] = ()
    draft_state: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.target_state) + len(self.draft_state)


def write_entry(path: Path, key: KvKey, entry: KvEntry) -> None:
    """`path` holds `entry` under `key`, or what it held before (atomic, readable by its owner only)."""
    header = {"magic": MAGIC, "key": key.as_json(), "target_tokens": list(entry.target_tokens),
              "draft_tokens": list(entry.draft_tokens), "target_bytes": len(entry.target_state),
              "draft_bytes": len(entry.draft_state), "sha256": _digest(entry.target_state, entry.draft_state),
              "written_at": time.time()}
    write_atomic(path, [json.dumps(header).encode() + b"\n", entry.target_state, entry.draft_state])


def read_entry(path: Path, key: KvKey) -> KvEntry:
    """The entry in `path`, or KvStoreError saying in a few words why it cannot be used here."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise NotKvFile(f"cannot read {path}: {e.strerror or e}") from None
    head, sep, body = data.partition(b"\n")
    try:
        header = json.loads(head) if sep else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise NotKvFile(f"{path} is not a specchat KV file")
    why = key.differs(header.get("key"))
    if why:
        raise KvStoreError(f"{path}: {why}")
    try:
        tb, db = int(header["target_bytes"]), int(header["draft_bytes"])
        target_tokens = tuple(int(t) for t in header["target_tokens"])
        draft_tokens = tuple(int(t) for t in header["draft_tokens"])
    except (KeyError, TypeError, ValueError):
        raise KvStoreError(f"{path}: its header is damaged") from None
    if len(body) != tb + db or tb <= 0 or not target_tokens:
        raise KvStoreError(f"{path} is truncated or damaged ({len(body)} bytes of cells, {tb + db} expected)")
    if header.get("sha256") != _digest(body[:tb], body[tb:]):
        raise KvStoreError(f"{path} is damaged (its cells do not match their checksum)")
    return KvEntry(target_tokens, body[:tb], draft_tokens, body[tb:])


def _digest(*blobs: bytes) -> str:
    h = hashlib.sha256()
    for b in blobs:
        h.update(b)
    return h.hexdigest()


def snapshot(target: "KvSequence", draft: "KvSequence | None", upto: int | None = None, *, copy: bool = True,
             draft_shares: int = 0) -> KvEntry | None:
    """The cells of a slot's target (and draft) as an entry, each cut to its first `upto` tokens (the prompt
    of a run: what it held after is the answer); None when the target holds nothing. The draft's cells are in
    where the draft holds tokens and shares at least `draft_shares` of them with the target (the prompt cache
    asks for its MIN_TOKENS: not a conversation a strategy without a draft has since replaced in the
    target), and owns them (`KvSequence.owns_cells`: not a drafter that reads the target's). `copy=False`
    keeps the buffers llama.cpp wrote the cells into (bytearrays, for an owner that holds the only reference:
    the RAM prompt cache); otherwise they are copied to bytes."""
    from backends.kv import common_prefix

    for seq in (target, draft):
        if seq is not None and upto is not None and len(seq.tokens) > upto:
            seq.cut(upto)  # where llama.cpp cannot cut there (a recurrent state past its snapshots), it holds none
    if not target.tokens or (upto is not None and len(target.tokens) < upto):
        return None
    own = bytes if copy else (lambda state: state)
    draft_tokens: tuple[int, ...] = ()
    draft_state: bytes = b"" if copy else bytearray()
    if draft is not None and draft.owns_cells and draft.tokens \
            and common_prefix(draft.tokens, target.tokens) >= draft_shares:
        draft_state = own(draft.save())  # first: an MTP head drops its drafted rows when saved
        draft_tokens = tuple(draft.tokens)
    return KvEntry(tuple(target.tokens), own(target.save()), draft_tokens, draft_state)


def restore(entry: KvEntry, target: "KvSequence", draft: "KvSequence | None", prompt: Sequence[int]) -> int:
    """Put an entry's cells back where they start `prompt` (the whole entry is a prefix of it, or the prompt
    a prefix of the entry's tokens, whose extra cells are dropped); the tokens of the prompt the target now
    holds (0: nothing restored, the prompt decodes as without the file)."""
    from backends.kv import common_prefix

    shared = common_prefix(entry.target_tokens, prompt)
    if shared <= common_prefix(target.tokens, prompt):
        return 0  # the cache holds as much already
    if not target.restore(entry.target_tokens, bytearray(entry.target_state)):
        return 0
    # A state read back has no snapshots to undo with: a recurrent target (Qwen3.5's) cannot be cut inside it,
    # and then holds nothing: the prompt decodes as without the file (a conversation edited since, or a thinking
    # template that drops earlier reasoning, leaves the entry past where the prompt differs).
    if target.cut(shared) < shared:
        return 0
    if draft is not None and entry.draft_state:
        d_shared = common_prefix(entry.draft_tokens, prompt)
        if d_shared > common_prefix(draft.tokens, prompt) and \
                draft.restore(entry.draft_tokens, bytearray(entry.draft_state)):
            draft.cut(d_shared)
    return len(target.tokens)


# The store's bound when none is given: room for about ten 4,000-token conversations of a 7B model with a
# grouped-query cache (57 kB a token: Qwen2.5-7B's 28 layers x 2 x 4 heads x 128 x 2 bytes), or a few hundred of
# SmolLM2's (23 kB a token for the target, as much for its draft).
DISK_BYTES = 2_000_000_000
# Conversations shorter than this are not kept: they decode in about the time reading them back takes.
MIN_TOKENS = 64
KV_DIR = "kv"
# A write killed midway (SIGKILL, OOM, power) leaves its temporary file (models.files.write_atomic: written beside,
# then renamed); one this old is nobody's write in progress, and the store's bound deletes it.
STALE_TMP_S = 600.0


def leftovers(folder: Path) -> list[Path]:
    """What the store's files leave beside them: files set aside (.bad) and temporary files of writes cut short."""
    return [*folder.glob("*.bad"), *folder.glob(".*.tmp")] if folder.is_dir() else []


def kv_dir(configured: Path | None = None) -> Path | None:
    """The store's folder: `configured`, $SPECCHAT_KV_DIR (empty: off), else the data dir's `kv/`."""
    from models.paths import data_dir

    if configured is not None:
        return configured
    env = os.environ.get("SPECCHAT_KV_DIR")
    if env is not None:
        return Path(env).expanduser() if env else None
    return data_dir() / KV_DIR


def _yield_to_decoding() -> None:
    """The writer thread runs at the lowest priority (Linux: nice 19 for this thread alone), so that hashing
    and writing a conversation's cells (a second or so of CPU for 3,000 tokens) takes what llama.cpp's
    threads leave: measured on 2 cores, a next turn that started at once was 1.26x later to its first token
    and decoded at 0.89x with the writer at normal priority (docs/results.md). Where threads cannot be
    reniced (macOS, Windows), it runs as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class KvDiskStore:
    """Entries in a folder, one file each (named by the hash of their tokens and key), least recently used
    out beyond `max_bytes`; an entry whose tokens another one extends is replaced by it. Files of other keys
    (other models, contexts, builds) share the folder and the bound. Writes run on a thread of their own,
    after the turn that made them: the next turn never waits for the disk."""

    def __init__(self, folder: Path, key: KvKey, max_bytes: int = DISK_BYTES,
                 warn: Callable[[str], None] = lambda _m: None) -> None:
        self.folder = folder
        self.key = key
        self.max_bytes = max_bytes
        self.warn = warn
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store", initializer=_yield_to_decoding)
        self._index: dict[Path, tuple[int, ...]] | None = None  # this key's entries: their target tokens

    def _tag(self) -> str:
        return hashlib.sha256(json.dumps(self.key.as_json()).encode()).hexdigest()[:16]

    def _entries(self) -> dict[Path, tuple[int, ...]]:
        """This key's entries, read from their header lines once (a file that does not parse is set aside)."""
        if self._index is None:
            self._index = {}
            for path in sorted(self.folder.glob(f"{self._tag()}-*.kv")):
                try:
                    with path.open("rb") as f:
                        header = json.loads(f.readline())
                    if self.key.differs(header.get("key")) is None:
                        self._index[path] = tuple(int(t) for t in header["target_tokens"])
                except (OSError, ValueError, KeyError, TypeError, AttributeError):
                    self._set_aside(path, "its header does not parse")
        return self._index

    def _set_aside(self, path: Path, why: str) -> None:
        self.warn(f"KV file {path.name} set aside: {why}")
        try:
            path.rename(path.with_suffix(".bad"))
        except OSError:
            path.unlink(missing_ok=True)
        if self._index is not None:
            self._index.pop(path, None)

    def best(self, prompt: Sequence[int], holds: int = 0) -> KvEntry | None:
        """The entry that starts `prompt` with the longest prefix, if it beats `holds` (what the cache holds
        already) by MIN_TOKENS; a file that no longer reads is set aside, and None."""
        from backends.kv import common_prefix

        self.wait()
        best, shared = None, holds + MIN_TOKENS - 1
        for path, tokens in self._entries().items():
            n = common_prefix(tokens, prompt)
            if n > shared:
                best, shared = path, n
        if best is None:
            return None
        try:
            entry = read_entry(best, self.key)
        except KvStoreError as e:
            self._set_aside(best, str(e).removeprefix(f"{best}: "))
            return None
        best.touch()  # recently used
        return entry

    def put(self, entry: KvEntry) -> None:
        """Keep `entry` (written on the store's thread); shorter than MIN_TOKENS, or larger than the bound, not."""
        if len(entry.target_tokens) < MIN_TOKENS or entry.nbytes > self.max_bytes:
            return
        self._pool.submit(self._write, entry)

    def _write(self, entry: KvEntry) -> None:
        try:
            name = hashlib.sha256(repr(entry.target_tokens).encode()).hexdigest()[:24]
            path = self.folder / f"{self._tag()}-{name}.kv"
            write_entry(path, self.key, entry)
            index = self._entries()
            for other, tokens in list(index.items()):  # what this entry extends, it replaces
                if other != path and entry.target_tokens[:len(tokens)] == tokens:
                    other.unlink(missing_ok=True)
                    del index[other]
            index[path] = entry.target_tokens
            self._bound()
        except OSError as e:
            self.warn(f"KV file not written: {e.strerror or e}")

    def _bound(self) -> None:
        """Least recently used files out until the folder (every key's files, and those set aside) is within the
        bound; a write's temporary file older than STALE_TMP_S (its writer was killed) goes at once."""
        files, now = [], time.time()
        for path in [*self.folder.glob("*.kv"), *leftovers(self.folder)]:
            try:
                st = path.stat()
            except OSError:
                continue
            if path.suffix == ".tmp":
                if now - st.st_mtime > STALE_TMP_S:
                    path.unlink(missing_ok=True)
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            if self._index is not None:
                self._index.pop(path, None)
            total -= size

    def wait(self) -> None:
        """Until every write handed to the store is on disk."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def describe_store(folder: Path) -> dict[str, object]:
    """What the store holds, without loading a model: entries, bytes, set-aside files."""
    files = list(folder.glob("*.kv")) if folder.is_dir() else []
    aside = leftovers(folder)
    return {"folder": str(folder), "entries": len(files), "bytes": sum(map(_size, files + aside)),
            "set_aside": len(aside)}


def _size(path: Path) -> int:
    """A file's size; 0 for one gone since it was listed (a write in progress renamed, another's eviction)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
