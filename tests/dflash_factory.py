"""A tiny llama target and a DFlash (or DSpark) block draft GGUF for it, written with `gguf.GGUFWriter`.

llama.cpp 0.3.36 reads a DFlash draft as architecture `dflash`
(src/models/dflash.cpp; docs/dflash-protocol.md): the target's layer inputs
at each committed position, concatenated (`dflash.target_layers`), go through
`fc` and a norm into keys and values of every draft layer ("injection"); a
drafting decode is a block `[last token, <mask> x k]` whose rows attend,
non-causally, to those cells and to each other, and the mask rows' logits
are the drafts. The draft's hidden size is the target's (llama.cpp builds the
injected rows as n_layers x n_embd of the draft), its tokenizer is the
target's plus a mask token (`tokenizer.ggml.mask_token_id`), and without
`token_embd.weight` / `output.weight` it borrows the target's through
`ctx_other`, as z-lab's published drafts do: so does this one.

Random weights would agree with the target by chance only; these make the
first draft of a block follow the target:
  - The target is eagle3_factory's: layer outputs scaled by `residual`, so its
    next token is mostly f(t) = argmax output · rms(embedding(t)). Column 0
    of its token embeddings is a flag, +1 for every token and -1 for the
    mask token, and column 0 of its output head is 0: the flag changes no
    next token of the target.
  - The draft's attention reads the flag alone on its last head dimension
    (not rotated: `rope.dimension_count` is 8 of 16), with Q = -flag and
    K = +flag, sharpened by `attn_q_norm`/`attn_k_norm` (`sharpness`): a mask
    row's query meets the anchor's key at +4 s^2 and another mask's at
    -4 s^2, the injected context cells (fc's row 0 is 0, so their flag
    is 0) at about 0. V is the identity and O is `mix` x identity, so a
    mask row's stream becomes mix x rms(embedding(anchor)) plus its own
    embedding: every mask row predicts f(anchor), which is right for the
    first draft (the target's next token) and, past it, only where f has a
    fixed point. `noise` adds random Q/K dimensions (rotated ones among them),
    which make the drafts depend on the injected features and on positions,
    so that a cell at the wrong place or of the wrong token shows.
  - DSpark (`markov_rank` > 0: `markov_w1`/`markov_w2`, llama-server's
    `draft-dspark`) reads its drafts from the anchor's row on
    (`dflash.sample_from_anchor`): with `anchor_first` the flag signs make
    the anchor attend to itself, so the anchor row predicts f(anchor), plus
    the Markov head's bias (`markov_noise`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from gguf_factory import Vocab, add_ffn, add_shape, add_vocab, gaussian, spm_vocab, write_llama_target, write_out

DFLASH_ARCH = "dflash"
MASK_PIECE = "<mask>"


def dflash_vocab(words: tuple[str, ...] | None = None, with_bytes: bool = True) -> Vocab:
    """spm_vocab with a control token `<mask>` (id 3), the draft's mask token."""
    kw = {} if words is None else {"words": words}
    return spm_vocab(control=(MASK_PIECE,), with_bytes=with_bytes, **kw)


@dataclass(frozen=True)
class DFlashPair:
    n_embd: int = 64          # target and draft hidden size
    n_layer: int = 4          # target layers
    target_layers: tuple[int, ...] = (1, 2, 3)  # inputs of these target layers are injected
    n_head: int = 4
    n_ff: int = 128
    n_ctx: int = 1024
    block_size: int = 8       # dflash.block_size: a DFlash block drafts at most block_size - 1 tokens
    residual: float = 0.05
    sharpness: float = 2.0
    mix: float = 8.0
    noise: float = 0.3
    ffn_noise: float = 0.3
    logit_scale: float = 1.0
    markov_rank: int = 0      # > 0: a DSpark draft (markov_w1/markov_w2)
    markov_noise: float = 0.5
    sample_from_anchor: bool = True
    anchor_first: bool = False  # the anchor's row predicts the next token (DSpark's anchor-first layout)
    mask_token: bool = True     # False: no tokenizer.ggml.mask_token_id (a file llama.cpp cannot draft with)
    n_embd_draft: int | None = None  # another hidden size than the target's (a file that does not fit it)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) < 16:
            raise ValueError("n_embd must be a multiple of n_head, heads of at least 16 dimensions")
        if not self.target_layers or not all(0 <= i < self.n_layer for i in self.target_layers):
            raise ValueError("target layer ids must be in [0, n_layer), at least one")
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2")
        if min(self.residual, self.sharpness, self.mix, self.noise, self.ffn_noise, self.markov_noise) < 0:
            raise ValueError("scales must be >= 0")


def write_dflash_pair(
    target_path: str | Path,
    draft_path: str | Path,
    seed: int = 0,
    model: DFlashPair = DFlashPair(),
    vocab: Vocab | None = None,
) -> None:
    """Write a llama target GGUF and a `dflash` draft GGUF for it (the target's tokenizer plus a mask token)."""
    m = model
    vocab = vocab or dflash_vocab()
    if MASK_PIECE not in vocab.tokens:
        raise ValueError(f"the vocabulary needs a {MASK_PIECE} token")
    mask = vocab.tokens.index(MASK_PIECE)
    rng = np.random.default_rng(seed)
    n_vocab, d, f = len(vocab.tokens), m.n_embd, m.n_ff
    rand = gaussian(rng)

    # --- target: llama, layer outputs scaled by `residual`; embedding column 0 is the mask flag, unread by output
    embd = rand((n_vocab, d), 1.0)
    embd[:, 0] = 1.0
    embd[mask, 0] = -1.0
    out = rand((n_vocab, d), m.logit_scale)
    out[:, 0] = 0.0
    write_llama_target(target_path, "tiny-dflash-target", vocab, m, rand, residual=m.residual, embd=embd, out=out)

    # --- draft: dflash, one layer, the target's token_embd and output through ctx_other (numpy shapes: out, in)
    dd = m.n_embd_draft or d
    hd_d = dd // m.n_head
    n_in = len(m.target_layers) * dd  # llama.cpp's injected row: n_layers x the draft's n_embd
    w = gguf.GGUFWriter(str(draft_path), DFLASH_ARCH)
    w.add_name("tiny-dflash-draft" if not m.markov_rank else "tiny-dspark-draft")
    # rope on the first 8 dimensions of each head: the flag's (the last) is not rotated
    add_shape(w, m, n_layer=1, n_embd=dd, n_rot=8)
    w.add_array(f"{DFLASH_ARCH}.target_layers", [int(i) for i in m.target_layers])  # INT32 array
    w.add_uint32(f"{DFLASH_ARCH}.block_size", m.block_size)
    if m.markov_rank:
        w.add_bool(f"{DFLASH_ARCH}.sample_from_anchor", m.sample_from_anchor)
        w.add_bool(f"{DFLASH_ARCH}.has_confidence_head", False)
    add_vocab(w, vocab)
    if m.mask_token:
        w.add_uint32("tokenizer.ggml.mask_token_id", mask)
    fc = rand((dd, n_in), 1.0 / np.sqrt(n_in))
    fc[0] = 0.0  # the injected cells carry no flag
    w.add_tensor("fc.weight", fc)
    w.add_tensor("enc.output_norm.weight", np.ones(dd, dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(dd, dtype=np.float32))
    q = rand((dd, dd), m.noise / np.sqrt(dd))
    k = rand((dd, dd), m.noise / np.sqrt(dd))
    sign = 1.0 if m.anchor_first else -1.0
    for h in range(m.n_head):
        row = h * hd_d + hd_d - 1
        q[row] = 0.0
        k[row] = 0.0
        q[row, 0] = sign
        k[row, 0] = 1.0
    w.add_tensor("blk.0.attn_q.weight", q)
    w.add_tensor("blk.0.attn_k.weight", k)
    w.add_tensor("blk.0.attn_v.weight", np.eye(dd, dtype=np.float32))
    w.add_tensor("blk.0.attn_output.weight", m.mix * np.eye(dd, dtype=np.float32))
    qk_norm = np.ones(hd_d, dtype=np.float32)
    qk_norm[-1] = m.sharpness
    w.add_tensor("blk.0.attn_q_norm.weight", qk_norm)
    w.add_tensor("blk.0.attn_k_norm.weight", qk_norm.copy())
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(dd, dtype=np.float32))
    add_ffn(w, 0, rand, dd, f, m.ffn_noise)
    w.add_tensor("output_norm.weight", np.ones(dd, dtype=np.float32))
    if m.markov_rank:
        w.add_tensor("markov_w1.weight", rand((n_vocab, m.markov_rank), 1.0))                   # {rank, n_vocab}
        w.add_tensor("markov_w2.weight", rand((n_vocab, m.markov_rank),
                                              m.markov_noise / np.sqrt(m.markov_rank)))          # {rank, n_vocab}
    write_out(w)
