"""A llama.cpp vocabulary as llguidance sees it, for grammars (backends.grammar).

backends.llama.LlamaModel.guidance_tokenizer reads every token's bytes from
llama.cpp (control tokens marked special with a 0xff byte, as llguidance's own
llama.cpp adapter marks them); this builds llguidance's tokenizer on them and
on llama.cpp's tokenizer, going through Python rather than the adapter's raw
pointer (which crashed the process on a vocabulary without byte tokens), and
checks that the tokens spell back what they tokenize.
"""

from __future__ import annotations

from typing import Callable

from models.errors import ModelError


def llguidance_tokenizer(name: str, tokens: list[bytes], tokenize: Callable[[str], list[int]], bos: int, eos: int,
                         eog_ids: tuple[int, ...]):  # -> llguidance.LLTokenizer
    """llguidance's tokenizer for the vocabulary `name` whose token t is `tokens[t]` and which `tokenize` (without
    special tokens) tokenizes; the end-of-generation tokens are the ends a grammar allows once complete. ModelError
    where its tokens do not spell back what it tokenizes."""
    import llguidance

    # A SentencePiece vocabulary that adds a space before every text (llama.cpp's add_space_prefix, Llama 2's
    # default) would make llguidance read that space as part of whatever it asks to tokenize: a text is
    # tokenized without it (the first token's leading space taken off and the rest spelt by the longest
    # pieces), so that the tokens spell exactly the text.
    probe = tokenize("a")
    adds_space = bool(probe) and tokens[probe[0]].startswith(b" ")
    by_piece = {p: t for t, p in enumerate(tokens) if p and not p.startswith(b"\xff")} if adds_space else {}
    longest = max(map(len, by_piece), default=1)

    def spell(data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            n = next((n for n in range(min(longest, len(data) - i), 0, -1) if data[i:i + n] in by_piece), 0)
            if n == 0:
                return []  # not spellable piece by piece: leave it to the tokenizer
            out.append(by_piece[data[i:i + n]])
            i += n
        return out

    class _Vocabulary:  # what llguidance.TokenizerWrapper reads
        eos_token_id = eos if eos >= 0 else (eog_ids[0] if eog_ids else 0)
        bos_token_id = bos if bos >= 0 else None
        special_token_ids = [t for t in range(len(tokens)) if tokens[t].startswith(b"\xff")]

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str | bytes) -> list[int]:
            s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
            ids = tokenize(s)
            if adds_space and ids and tokens[ids[0]].startswith(b" "):  # llama.cpp adds it to every text
                rest = tokens[ids[0]][1:]
                head = spell(rest) if rest else []
                if rest and not head:
                    return ids
                ids = head + ids[1:]
            return ids

    vocabulary = _Vocabulary()
    # llguidance allows a forced stretch only in the tokens this tokenizer spells it with: they must spell it
    # back byte for byte, or the grammar would refuse what its own mask allowed, mid-answer.
    for probe in ("{", '{"a": 1}', " x", "a b", "\n"):
        spelt = b"".join(tokens[t] for t in vocabulary(probe))
        if spelt != probe.encode():
            raise ModelError(f"{name}: this vocabulary's tokenizer spells {probe!r} as {spelt!r}, so "
                             "grammars cannot run on it")
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), n_vocab=len(tokens),
                                  eos_token=list(eog_ids) or None)
