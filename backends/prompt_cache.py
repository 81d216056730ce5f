"""Prompts the slots had to give up, kept in RAM so that a request that comes back decodes only what is new.

llama-server's prompt cache (tools/server/server-context.cpp,
`get_available_slot`, `--cache-ram`): a slot holds one conversation's cells,
and a new request takes the free slot whose cells share the longest prefix
with its prompt. When that would throw away most of what the slot holds (it
keeps under half), the slot's cells are saved first (llama.cpp's
`llama_state_seq_get_data`, a few MB a conversation for a small model), and
when a saved conversation shares a longer prefix with the new prompt than the
slot does, it is put back (`llama_state_seq_set_data`) before the request
decodes. So N slots serve more than N conversations, agents and editors that
resend the same long prefix, and a chat whose slot another client took, without
decoding their prompts again; greedy output is the same either way (the
restored cells are the ones the prompt would have decoded).

An entry is a slot's target cells and, where the slot has a draft sequence
(a draft model, an MTP head, an EAGLE-3 or DFlash drafter) that holds the
same conversation, the draft's cells with them (backends.kv_store.KvEntry):
both are put back together, so that a strategy that drafts does not decode
the prompt again in the draft. A draft that lagged holds fewer tokens; what
it lacks it decodes, as without the cache.

Bounded in bytes (the target's and the draft's cells), least recently used
first out. An entry whose tokens another entry extends is replaced by it (the
longer one serves every prompt the shorter one did).

With a disk store (backends.kv_store.KvDiskStore), what leaves RAM for room
goes to disk, and a prompt that no RAM entry starts well is looked up there;
when the server stops, every entry and every slot's cells (target and draft)
go to disk (`spill`), so a restarted server answers a returning conversation
or an agent's long prefix at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

from backends.kv import KvSequence, common_prefix
from backends.kv_store import KvDiskStore, KvEntry, snapshot

# A slot's cells are saved only when they hold at least this many tokens, and a saved conversation is put back
# only when that spares decoding at least this many: fewer decode in about one plain step (48 prompt tokens of
# SmolLM2 took 55 ms here, a plain step 11-14 ms), not worth an entry. Saving and putting back cost a tenth of
# a millisecond each (docs/results.md, "The prompt cache").
MIN_TOKENS = 16


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    saved: int  # conversations saved in all
    restored: int  # requests that started from a saved conversation
    tokens_restored: int  # prompt tokens those did not decode
    draft_tokens_restored: int  # prompt tokens their drafts did not decode

    def as_json(self) -> dict[str, int]:
        return asdict(self)


def _snapshot(target: KvSequence, draft: KvSequence | None) -> KvEntry:
    """A slot's cells (it holds some) as an entry, in the buffers llama.cpp wrote them into (no copy): the
    draft's too where it holds the target's conversation (kv_store.snapshot)."""
    entry = snapshot(target, draft, copy=False, draft_shares=MIN_TOKENS)
    assert entry is not None, "a slot with no cells is not saved"
    return entry


def _writable(state: bytes) -> bytearray:
    """llama.cpp reads a state from a writable buffer: a RAM entry's as it is, a disk entry's copied."""
    return state if isinstance(state, bytearray) else bytearray(state)


class PromptCache:
    """Saved slot states (target and draft) by the target's tokens, at most `max_bytes` in all (0: off)."""

    def __init__(self, max_bytes: int, disk: KvDiskStore | None = None) -> None:
        if max_bytes < 0:
            raise ValueError("the prompt cache's size must be 0 (off) or more")
        self.max_bytes = max_bytes
        self.disk = disk
        self._entries: OrderedDict[tuple[int, ...], KvEntry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._saved = self._restored = self._tokens_restored = self._draft_tokens_restored = 0

    def stats(self) -> CacheStats:
        return CacheStats(len(self._entries), self._bytes, self._saved, self._restored, self._tokens_restored,
                          self._draft_tokens_restored)

    def before_prompt(self, target: KvSequence, draft: KvSequence | None, prompt: Sequence[int]) -> None:
        """A slot (its `target` sequence, and its `draft` or None) is about to take `prompt`: keep what it holds
        when the prompt would lose most of it, then start it from the saved conversation sharing the longest
        prefix with the prompt, where that beats what it holds by at least MIN_TOKENS."""
        if not self.max_bytes:
            return
        keep = common_prefix(target.tokens, prompt)
        if len(target.tokens) >= MIN_TOKENS and keep < len(target.tokens) / 2:
            self._put(target, draft)
        best, shared = None, keep
        for tokens in self._entries:
            n = common_prefix(tokens, prompt)
            if n > shared:
                best, shared = tokens, n
        if best is None or shared - keep < MIN_TOKENS:
            entry = self.disk.best(prompt, max(keep, shared)) if self.disk is not None else None
            if entry is not None:
                self._put_back(entry, target, draft, prompt)
            return
        self._entries.move_to_end(best)
        if not self._put_back(self._entries[best], target, draft, prompt):
            self._drop(best)  # no room for its cells now: the prompt decodes as it would have without the cache

    def _put_back(self, entry: KvEntry, target: KvSequence, draft: KvSequence | None,
                  prompt: Sequence[int]) -> bool:
        """The entry's cells into the slot: the target's, and the draft's where they start the prompt further
        than what the draft holds. Whole: the strategy's syncing cuts what the prompt does not share, where
        llama.cpp can (a cache that cannot is decoded again, KvSequence.cut). False when llama.cpp could not
        take the target's (the slot then holds nothing of the target's: the prompt decodes)."""
        keep = common_prefix(target.tokens, prompt)
        if not target.restore(entry.target_tokens, _writable(entry.target_state)):
            return False
        self._restored += 1
        self._tokens_restored += common_prefix(entry.target_tokens, prompt) - keep
        if draft is not None and entry.draft_state:
            had, shared = common_prefix(draft.tokens, prompt), common_prefix(entry.draft_tokens, prompt)
            if shared > had and draft.restore(entry.draft_tokens, _writable(entry.draft_state)):
                self._draft_tokens_restored += shared - had
        return True

    def _put(self, target: KvSequence, draft: KvSequence | None) -> None:
        tokens = tuple(target.tokens)
        with_draft = draft is not None and draft.owns_cells and common_prefix(draft.tokens, tokens) >= MIN_TOKENS
        shorter = []
        for other, kept in self._entries.items():
            if other[:len(tokens)] == tokens[:len(other)]:  # one extends the other
                # The longer one stays; of two alike, the one that holds a draft's cells.
                if len(other) > len(tokens) or (len(other) == len(tokens) and (kept.draft_state or not with_draft)):
                    self._entries.move_to_end(other)
                    return
                shorter.append(other)
        entry = _snapshot(target, draft)
        if entry.nbytes > self.max_bytes:  # never fits: the shorter entries it extends stay
            return
        for other in shorter:
            self._drop(other)
        while self._bytes + entry.nbytes > self.max_bytes:
            oldest = next(iter(self._entries))
            if self.disk is not None:  # out of RAM, onto disk (RAM keeps no reference: the buffers are not copied)
                self.disk.put(self._entries[oldest])
            self._drop(oldest)
        self._entries[tokens] = entry
        self._bytes += entry.nbytes
        self._saved += 1

    def _drop(self, tokens: tuple[int, ...]) -> None:
        self._bytes -= self._entries.pop(tokens).nbytes

    def spill(self, held: Sequence[tuple[KvSequence, KvSequence | None]] = ()) -> None:
        """Every entry, and the cells each slot of `held` (its target and draft sequences) holds, onto disk (the
        server stops); waits for the writes."""
        if self.disk is None:
            return
        for entry in self._entries.values():
            self.disk.put(entry)
        for target, draft in held:
            if target.tokens:
                self.disk.put(_snapshot(target, draft))
        self.disk.close()
