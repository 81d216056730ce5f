"""A tiny llama target and an EAGLE-3 draft GGUF for it, written with `gguf.GGUFWriter`.

llama.cpp 0.3.36 reads an EAGLE-3 draft as architecture `eagle3`
(src/models/eagle3.cpp): one decoder layer whose attention takes the
concatenation [rms(token embedding) ; rms(g)], where g = fc(three target
hidden states concatenated). The GGUF names the target layers in
`eagle3.target_layers` (exactly three ids; llama.cpp extracts the *input* of
each of those target layers) and their width in `eagle3.target_hidden_size`.
An optional I64 tensor `d2t` (absolute target token ids, one per row of the
draft's `output.weight`) gives a reduced draft vocabulary. Without its own
`token_embd.weight` the draft borrows the target's through the draft
context's `ctx_other` (as the Llama 3.1 8B EAGLE-3 drafts do); see
docs/eagle3-protocol.md for how the pair runs.

Random weights would agree with the target by chance only, so, as in
tests/drafter_factory.py, the weights make agreement tunable:
  - The target's attention and FFN outputs are scaled by `residual`: at 0
    its next token is a function of the current token alone,
    f(t) = argmax output · rms(embedding(t)).
  - The draft's attention is a sharp self-lookup: Q = K = `sharpness` · the
    token half of its input, V = that half, O = identity, so the residual
    stream gets rms(embedding(t_{P+1})) for its input pair (t_{P+1}, g_P).
    Its lm_head is the target's output rows for the draft vocabulary, so it
    predicts f(t_{P+1}) restricted to that vocabulary. `head_noise` scales
    g's share of the residual stream and the draft's FFN: 0 copies a
    residual-free target.
  - g is the target features on the first draft step but the draft's own
    pre-norm hidden state on the next ones (llama.cpp feeds it back), so a
    residual stream that adds g itself (mainline EAGLE-3,
    `norm_before_residual` False) piles the earlier tokens up and only the
    first draft token can be exact; with `norm_before_residual` True
    (the RedHat speculators' variant, the default here) the stream adds
    rms(g) · hidden_norm, bounded by `head_noise`, and every draft token can
    (hidden_norm has random signs, so the fed-back state of the previous
    token is noise, not a vote for that token's successor).
  - The reduced vocabulary holds the most frequent values of f first (as
    real EAGLE-3 drafts keep the most frequent tokens), then the lowest ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from gguf_factory import Vocab, add_ffn, add_shape, add_vocab, gaussian, spm_vocab, write_llama_target, write_out

EAGLE3_ARCH = "eagle3"


@dataclass(frozen=True)
class Eagle3Pair:
    n_embd: int = 64          # target and draft hidden size (the draft borrows the target's token_embd)
    n_layer: int = 4          # target layers
    target_layers: tuple[int, int, int] = (1, 2, 3)  # inputs of these target layers feed the draft
    n_head: int = 4
    n_ff: int = 128
    n_ctx: int = 1024
    draft_vocab: int | None = 128  # rows of the draft's lm_head (+ d2t); None: the full vocabulary, no d2t
    own_tok_embd: bool = False    # True: the draft carries token_embd.weight and needs no ctx_other for it
    residual: float = 0.2
    head_noise: float = 0.3
    norm_before_residual: bool = True  # the RedHat-style variant; False: mainline EAGLE-3 (see the module doc)
    sharpness: float = 4.0
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError("n_embd must be a multiple of n_head")
        if len(self.target_layers) != 3:
            raise ValueError("EAGLE-3 needs exactly 3 target layers")
        if not all(0 <= i < self.n_layer for i in self.target_layers):
            raise ValueError("target layer ids must be in [0, n_layer)")
        if self.residual < 0 or self.head_noise < 0:
            raise ValueError("residual and head_noise must be >= 0")


def _rms(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _draft_ids(m: Eagle3Pair, embd: np.ndarray, out: np.ndarray) -> np.ndarray | None:
    """Target ids of the draft vocabulary, ascending: the most frequent f(t) first, then the lowest ids."""
    n_vocab = embd.shape[0]
    if m.draft_vocab is None:
        return None
    if not 0 < m.draft_vocab <= n_vocab:
        raise ValueError(f"draft_vocab must be in [1, {n_vocab}]")
    f = np.argmax(_rms(embd) @ out.T, axis=1)
    ids, counts = np.unique(f, return_counts=True)
    chosen = [int(i) for i in ids[np.argsort(-counts, kind="stable")]][: m.draft_vocab]
    rest = (i for i in range(n_vocab) if i not in set(chosen))
    while len(chosen) < m.draft_vocab:
        chosen.append(next(rest))
    return np.array(sorted(chosen), dtype=np.int64)


def write_eagle3_pair(
    target_path: str | Path,
    draft_path: str | Path,
    seed: int = 0,
    model: Eagle3Pair = Eagle3Pair(),
    vocab: Vocab | None = None,
    draft_layers: tuple[int, ...] | None = None,
) -> None:
    """Write a llama target GGUF and an `eagle3` draft GGUF for it (same tokenizer). `draft_layers` overrides the
    draft's `eagle3.target_layers` key alone (a draft that names other layers than it was built for: for tests
    of its refusal)."""
    m = model
    vocab = vocab or spm_vocab()
    rng = np.random.default_rng(seed)
    n_vocab, d, f = len(vocab.tokens), m.n_embd, m.n_ff
    rand = gaussian(rng)
    ones = np.ones(d, dtype=np.float32)

    # --- target: llama, the layers' outputs scaled by `residual`
    embd = rand((n_vocab, d), 1.0)
    out = rand((n_vocab, d), m.logit_scale)
    write_llama_target(target_path, "tiny-eagle3-target", vocab, m, rand, residual=m.residual, embd=embd, out=out)

    # --- draft: eagle3, one layer (ggml shapes in comments: ne0 = input width)
    d2t = _draft_ids(m, embd, out)
    eye = np.eye(d, dtype=np.float32)
    zero = np.zeros((d, d), dtype=np.float32)
    w = gguf.GGUFWriter(str(draft_path), EAGLE3_ARCH)
    w.add_name("tiny-eagle3-draft")
    add_shape(w, m, n_layer=1)
    layers = m.target_layers if draft_layers is None else draft_layers
    w.add_array(f"{EAGLE3_ARCH}.target_layers", [int(i) for i in layers])  # INT32 array
    w.add_uint32(f"{EAGLE3_ARCH}.target_hidden_size", d)
    w.add_bool(f"{EAGLE3_ARCH}.norm_before_residual", m.norm_before_residual)
    add_vocab(w, vocab)  # the target's tokenizer, as convert_hf_to_gguf.py writes it for a draft
    if m.own_tok_embd:
        w.add_tensor("token_embd.weight", embd)                                   # {d, n_vocab}
    # g's weight in the residual stream: through hidden_norm's weight when the residual takes rms(g),
    # through fc when it takes g itself
    g_scale = 1.0 if m.norm_before_residual else m.head_noise
    # random signs: the draft's own hidden state, fed back as g, then adds noise, not its last token's logits
    signs = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=d)
    hidden_norm = m.head_noise * signs if m.norm_before_residual else ones
    w.add_tensor("fc.weight", rand((d, 3 * d), g_scale / np.sqrt(3 * d)))         # {3d, d}
    w.add_tensor("blk.0.attn_norm.weight", ones)                                  # on the token embedding
    w.add_tensor("blk.0.attn_norm_2.weight", hidden_norm)                         # hidden_norm, on g
    qk = np.concatenate([m.sharpness * eye, zero], axis=1)                        # {2d, d}: token half only
    w.add_tensor("blk.0.attn_q.weight", qk)
    w.add_tensor("blk.0.attn_k.weight", qk)
    w.add_tensor("blk.0.attn_v.weight", np.concatenate([eye, zero], axis=1))
    w.add_tensor("blk.0.attn_output.weight", eye)
    w.add_tensor("blk.0.ffn_norm.weight", ones)
    add_ffn(w, 0, rand, d, f, m.head_noise)
    w.add_tensor("output_norm.weight", ones)
    if d2t is None:
        w.add_tensor("output.weight", out)                                        # {d, n_vocab}
    else:
        w.add_tensor("output.weight", out[d2t])                                   # {d, n_draft_vocab}
        w.add_tensor("d2t", d2t)                                                  # I64 {n_draft_vocab}
    write_out(w)
