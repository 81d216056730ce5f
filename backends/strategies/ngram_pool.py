"""The n-gram pool of lookahead decoding (Fu et al. 2024, section 3.2).

For every token, a ring buffer of at most G distinct n-grams of N-1 tokens that
followed it, as llama.cpp's `ngram_container` in examples/lookahead: slots are
read in slot order, a new n-gram goes to the head slot (overwriting the oldest
once G are held), duplicates are skipped.
"""

from __future__ import annotations

from typing import Sequence


class NgramPool:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # G
        self._slots: dict[int, list[tuple[int, ...]]] = {}
        self._head: dict[int, int] = {}
        self.added = 0

    def get(self, first: int) -> tuple[tuple[int, ...], ...]:
        """The n-grams after `first`, in slot order (a snapshot: later adds do not change it)."""
        return tuple(self._slots.get(first, ()))

    def add(self, first: int, gram: Sequence[int]) -> bool:
        """Store `gram` as a continuation of `first`; False if it is already there (or G is 0)."""
        if self.capacity == 0:
            return False
        gram = tuple(gram)
        slots = self._slots.setdefault(first, [])
        if gram in slots:
            return False
        head = self._head.get(first, 0)
        if len(slots) < self.capacity:
            slots.append(gram)
        else:
            slots[head] = gram
        self._head[first] = (head + 1) % self.capacity
        self.added += 1
        return True

    def seed(self, tokens: Sequence[int], gram_len: int) -> None:
        """Add every full n-gram of a token sequence (e.g. the prompt)."""
        for i in range(len(tokens) - gram_len):
            self.add(tokens[i], tokens[i + 1 : i + 1 + gram_len])

    def __len__(self) -> int:
        return sum(len(s) for s in self._slots.values())
