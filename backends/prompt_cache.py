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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

from backends.kv import KvSequence, common_prefix

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

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("the prompt cache's size must be 0 (off) or more")
        self.max_bytes = max_bytes
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
            self._drop(next(iter(self._entries)))
        self._entries[tokens] = state
        self._bytes += len(state)
        self._saved += 1

    def _drop(self, tokens: tuple[int, ...]) -> None:
        self._bytes -= len(self._entries.pop(tokens))
