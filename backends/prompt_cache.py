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

Bounded in bytes, least recently used first out. An entry whose tokens
another entry extends is replaced by it (the longer one serves every prompt
the shorter one did).

With a disk store (backends.kv_store.KvDiskStore), what leaves RAM for room
goes to disk, and a prompt that no RAM entry starts well is looked up there;
when the server stops, every entry and every slot's cells go to disk
(`spill`), so a restarted server answers a returning conversation or an
agent's long prefix at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

from backends.kv import KvSequence, common_prefix
from backends.kv_store import KvDiskStore, KvEntry, restore

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

    def as_json(self) -> dict[str, int]:
        return asdict(self)


class PromptCache:
    """Saved sequence states by their tokens, at most `max_bytes` in all (0: off)."""

    def __init__(self, max_bytes: int, disk: KvDiskStore | None = None) -> None:
        if max_bytes < 0:
            raise ValueError("the prompt cache's size must be 0 (off) or more")
        self.max_bytes = max_bytes
        self.disk = disk
        self._entries: OrderedDict[tuple[int, ...], bytearray] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._saved = self._restored = self._tokens_restored = 0

    def stats(self) -> CacheStats:
        return CacheStats(len(self._entries), self._bytes, self._saved, self._restored, self._tokens_restored)

    def before_prompt(self, seq: KvSequence, prompt: Sequence[int]) -> None:
        """`seq` is about to take `prompt`: keep what it holds when the prompt would lose most of it, then start
        it from the saved conversation sharing the longest prefix with the prompt, where that beats what it
        holds by at least MIN_TOKENS."""
        if not self.max_bytes:
            return
        keep = common_prefix(seq.tokens, prompt)
        if len(seq.tokens) >= MIN_TOKENS and keep < len(seq.tokens) / 2:
            self._put(tuple(seq.tokens), seq)
        best, shared = None, keep
        for tokens in self._entries:
            n = common_prefix(tokens, prompt)
            if n > shared:
                best, shared = tokens, n
        if best is None or shared - keep < MIN_TOKENS:
            self._from_disk(seq, prompt, max(keep, shared))
            return
        self._entries.move_to_end(best)
        if seq.restore(best, self._entries[best]):
            self._restored += 1
            self._tokens_restored += shared - keep
        else:  # no room for its cells now: the prompt decodes as it would have without the cache
            self._drop(best)

    def _put(self, tokens: tuple[int, ...], seq: KvSequence) -> None:
        shorter = []
        for other in self._entries:
            if other[:len(tokens)] == tokens[:len(other)]:  # one extends the other
                if len(other) >= len(tokens):
                    self._entries.move_to_end(other)
                    return
                shorter.append(other)
        state = seq.save()
        if len(state) > self.max_bytes:  # never fits: the shorter entries it extends stay
            return
        for other in shorter:
            self._drop(other)
        while self._bytes + len(state) > self.max_bytes:
            oldest = next(iter(self._entries))
            if self.disk is not None:  # out of RAM, onto disk
                self.disk.put(KvEntry(oldest, bytes(self._entries[oldest])))
            self._drop(oldest)
        self._entries[tokens] = state
        self._bytes += len(state)
        self._saved += 1

    def _drop(self, tokens: tuple[int, ...]) -> None:
        self._bytes -= len(self._entries.pop(tokens))

    def _from_disk(self, seq: KvSequence, prompt: Sequence[int], holds: int) -> None:
        """The disk store's entry that starts `prompt` best, where it beats `holds` tokens by MIN_TOKENS."""
        if self.disk is None:
            return
        entry = self.disk.best(prompt, holds)
        if entry is not None:
            before = common_prefix(seq.tokens, prompt)
            n = restore(entry, seq, None, prompt)
            if n:
                self._restored += 1
                self._tokens_restored += n - before

    def spill(self, held: Sequence[KvSequence] = ()) -> None:
        """Every entry, and the cells each of `held` holds, onto disk (the server stops); waits for the writes."""
        if self.disk is None:
            return
        for tokens, state in self._entries.items():
            self.disk.put(KvEntry(tokens, bytes(state)))
        for seq in held:
            if seq.tokens:
                self.disk.put(KvEntry(tuple(seq.tokens), bytes(seq.save())))
        self.disk.close()
