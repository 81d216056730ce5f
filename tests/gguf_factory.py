"""Tiny llama-architecture GGUF files written with `gguf.GGUFWriter`.

Random weights, a SentencePiece-style vocabulary (byte tokens plus a few
words), F32 tensors: llama.cpp loads them in milliseconds, so the tests run the
real engine on real files. A draft is the target plus Gaussian noise: the
larger the noise, the lower the acceptance.

The other factories (drafter_, eagle3_, dflash_, qwen35_factory) write their
files from the pieces here: the tokenizer (`add_vocab`), the weights
(`gaussian`), a llama header (`add_shape`), attention and FFN blocks, and the
whole llama target (`write_llama_target`) beside an EAGLE-3 or DFlash draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import gguf
import numpy as np

# SentencePiece token types as llama.cpp reads them.
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6

WORDS = (
    "the", "a", "cat", "dog", "sat", "on", "mat", "and", "ran", "to", "house", "big",
    "small", "red", "blue", "once", "upon", "time", "there", "was", "code", "def",
    "return", "print", "hello", "world", ",", ".", "!", "?", "is", "in",
)


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[int, ...]


def spm_vocab(words: tuple[str, ...] = WORDS, with_bytes: bool = True, space: bool = False,
              control: tuple[str, ...] = ()) -> Vocab:
    """<unk>, <s>, </s>, the `control` tokens (a chat format's tags, as control tokens: they render as nothing),
    optionally the 256 byte tokens, then '▁word' and 'word' pieces; with `space`, a '▁' token too, so that a
    space is spelt as SentencePiece models spell it (without it, llama.cpp's SentencePiece tokenizer spells " "
    as the three bytes of '▁', which no grammar engine can read back as a space)."""
    tokens: list[str] = ["<unk>", "<s>", "</s>", *control]
    types = [_UNKNOWN, _CONTROL, _CONTROL, *[_CONTROL] * len(control)]
    if with_bytes:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [_BYTE] * 256
    else:
        tokens.append("<0x0A>")  # llama.cpp looks up the newline token when loading
        types.append(_BYTE)
    if space:
        tokens.append("\u2581")
        types.append(_NORMAL)
    for w in words:
        for piece in (f"\u2581{w}", w):
            if piece not in tokens:
                tokens.append(piece)
                types.append(_NORMAL)
    scores = [0.0] * len(tokens)
    for i, t in enumerate(tokens):
        if types[i] == _NORMAL:
            scores[i] = -float(i) / 100.0 + (2.0 if t.startswith("\u2581") else 0.0)
    return Vocab(tuple(tokens), tuple(scores), tuple(types))


def write_out(w: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and the tensors, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_vocab(w: gguf.GGUFWriter, vocab: Vocab) -> None:
    """The vocabulary as a SentencePiece ('llama') tokenizer: <s> = 1 added first, </s> = 2, <unk> = 0."""
    w.add_tokenizer_model("llama")
    w.add_token_list(list(vocab.tokens))
    w.add_token_scores(list(vocab.scores))
    w.add_token_types(list(vocab.types))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


@dataclass(frozen=True)
class TinyModel:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_ff: int = 128
    n_ctx: int = 1024
    seed: int = 0
    logit_scale: float = 0.6  # output weight std: larger -> peakier distributions, fewer near-ties


class Shape(Protocol):
    """A llama-shaped model's sizes (TinyModel, eagle3_factory.Eagle3Pair, dflash_factory.DFlashPair)."""

    @property
    def n_embd(self) -> int: ...
    @property
    def n_layer(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def n_ff(self) -> int: ...
    @property
    def n_ctx(self) -> int: ...
    @property
    def logit_scale(self) -> float: ...


Weight = Callable[[tuple[int, ...], float], np.ndarray]  # (shape, std) -> F32 weights, drawn in call order


def gaussian(rng: np.random.Generator, noise: float = 0.0, noise_rng: np.random.Generator | None = None) -> Weight:
    """N(0, std) weights from `rng`; with `noise` > 0 each plus N(0, noise * std) from `noise_rng` (a draft that
    is the same model perturbed)."""

    def weight(shape: tuple[int, ...], std: float) -> np.ndarray:
        w = rng.normal(0.0, std, size=shape)
        if noise > 0:
            assert noise_rng is not None
            w = w + noise_rng.normal(0.0, noise * std, size=shape)
        return w.astype(np.float32)

    return weight


def add_shape(w: gguf.GGUFWriter, m: Shape, n_layer: int | None = None, n_embd: int | None = None,
              n_rot: int | None = None) -> None:
    """A llama-shaped file's hyperparameters (F32, RMS norm eps 1e-5): `m`'s, or the block count, hidden size
    and rotary width given (the rotary width defaults to a head's)."""
    d = n_embd or m.n_embd
    w.add_context_length(m.n_ctx)
    w.add_embedding_length(d)
    w.add_block_count(m.n_layer if n_layer is None else n_layer)
    w.add_feed_forward_length(m.n_ff)
    w.add_head_count(m.n_head)
    w.add_head_count_kv(m.n_head)
    w.add_rope_dimension_count(n_rot or d // m.n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def add_attention(w: gguf.GGUFWriter, i: int, weight: Weight, d: int, out_scale: float = 1.0) -> None:
    """Block i's plain multi-head attention: Q, K, V, and the output scaled by `out_scale`."""
    s = 1.0 / np.sqrt(d)
    for name in ("attn_q", "attn_k", "attn_v"):
        w.add_tensor(f"blk.{i}.{name}.weight", weight((d, d), s))
    w.add_tensor(f"blk.{i}.attn_output.weight", weight((d, d), s * out_scale))


def add_ffn(w: gguf.GGUFWriter, i: int, weight: Weight, d: int, f: int, out_scale: float = 1.0) -> None:
    """Block i's SwiGLU FFN: gate, up, and down scaled by `out_scale`."""
    s = 1.0 / np.sqrt(d)
    w.add_tensor(f"blk.{i}.ffn_gate.weight", weight((f, d), s))
    w.add_tensor(f"blk.{i}.ffn_up.weight", weight((f, d), s))
    w.add_tensor(f"blk.{i}.ffn_down.weight", weight((d, f), out_scale / np.sqrt(f)))


def write_llama_target(path: str | Path, name: str, vocab: Vocab, m: Shape, weight: Weight, *,
                       residual: float = 1.0, embd: np.ndarray | None = None, out: np.ndarray | None = None,
                       architecture: str = "llama", chat_template: str | None = None) -> Path:
    """Write a llama GGUF of shape `m`: the header, the tokenizer, the weights drawn from `weight` in file order,
    each layer's attention and FFN outputs scaled by `residual`. The token embeddings and the output head are
    drawn first and last (std 1 and `m.logit_scale`) unless given."""
    d = m.n_embd
    ones = np.ones(d, dtype=np.float32)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name(name)
    add_shape(w, m)
    add_vocab(w, vocab)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", weight((len(vocab.tokens), d), 1.0) if embd is None else embd)
    for i in range(m.n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        add_attention(w, i, weight, d, residual)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        add_ffn(w, i, weight, d, m.n_ff, residual)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", weight((len(vocab.tokens), d), m.logit_scale) if out is None else out)
    write_out(w)
    return Path(path)


def write_llama_gguf(
    path: Path,
    vocab: Vocab | None = None,
    model: TinyModel = TinyModel(),
    noise: float = 0.0,
    noise_seed: int = 1,
    architecture: str = "llama",
    chat_template: str | None = None,
) -> Path:
    """Write a loadable llama GGUF. `noise` > 0 perturbs every weight (a 'draft' of the seed's model)."""
    weight = gaussian(np.random.default_rng(model.seed), noise, np.random.default_rng(noise_seed))
    return write_llama_target(path, "tiny-test", vocab or spm_vocab(), model, weight, architecture=architecture,
                              chat_template=chat_template)
