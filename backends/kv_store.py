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

The restored cells are the ones decoding the same tokens would have made, so
every strategy's output after a restore is token for token what it is after
decoding the prompt at temperature 0.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from backends.device_cost import file_identity
from models.files import write_atomic

if TYPE_CHECKING:
    from backends.kv import KvSequence

MAGIC = "specchat-kv/1"


class KvStoreError(ValueError):
    """A KV file that cannot be used here: another model or context, or not a whole file."""


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
    write_atomic(path, json.dumps(header).encode() + b"\n" + entry.target_state + entry.draft_state)


def read_entry(path: Path, key: KvKey) -> KvEntry:
    """The entry in `path`, or KvStoreError saying in a few words why it cannot be used here."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KvStoreError(f"cannot read {path}: {e.strerror or e}") from None
    head, sep, body = data.partition(b"\n")
    try:
        header = json.loads(head) if sep else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise KvStoreError(f"{path} is not a specchat KV file")
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


def snapshot(target: "KvSequence", draft: "KvSequence | None", upto: int | None = None) -> KvEntry | None:
    """The cells of a slot's target (and draft) as an entry, each cut to its first `upto` tokens (the prompt
    of a run: what it held after is the answer); None when the target holds nothing."""
    for seq in (target, draft):
        if seq is not None and upto is not None and len(seq.tokens) > upto:
            seq.truncate(upto)
    if not target.tokens:
        return None
    draft_tokens, draft_state = (), b""
    if draft is not None and draft.tokens:
        draft_tokens, draft_state = tuple(draft.tokens), bytes(draft.save())
    return KvEntry(tuple(target.tokens), bytes(target.save()), draft_tokens, draft_state)


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
    if shared < len(target.tokens):
        target.truncate(shared)
    if draft is not None and entry.draft_state:
        d_shared = common_prefix(entry.draft_tokens, prompt)
        if d_shared > common_prefix(draft.tokens, prompt) and \
                draft.restore(entry.draft_tokens, bytearray(entry.draft_state)) and d_shared < len(draft.tokens):
            draft.truncate(d_shared)
    return len(target.tokens)
