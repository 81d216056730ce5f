"""A tiny target whose GGUF carries several chained MTP heads, written with `gguf.GGUFWriter`.

The architecture is `hy_v3` (src/models/hy-v3.cpp), the simplest of the three
whose MTP graph runs any of several NextN blocks, picked per decode by
`llama_set_nextn_layer_offset`: plain attention with per-head q/k RMS norms,
NeoX RoPE over the whole head, dense SwiGLU layers where a block has no
router. Or `step35` (src/models/step35.cpp, the architecture llama.cpp's
chaining was written for), the same blocks with a sliding window on some
layers (the first trunk layer and the last head here: an iswa cache in both
contexts) and half the head rotated on the others. A GGUF with
`{arch}.nextn_predict_layers` = N has its last N blocks as heads: a plain
context runs the trunk, a context of type MTP runs head `offset` only, and
llama.cpp's `draft-mtp` chains them, draft k by head k (backends.mtp_chain).

Agreement is tunable as in tests/drafter_factory.py: the trunk's output
projections are scaled by `residual` (at 0 the target's logits after x are
output · norm(embedding(x))); each head's eh_proj passes the normed token
embedding through and scales the hidden state by `head_noise`, its attention
and FFN outputs by the same, and it shares the target's output head. At
head_noise 0 every head's row (x, h) predicts what a residual-free target
predicts after x. Every head has weights of its own (drawn one after the
other), so at large `head_noise` the heads draft differently: a driver that
ran head 0 for every draft would propose other tokens than the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from drafter_factory import add_nextn_tensors
from gguf_factory import Vocab, Weight, add_ffn, add_vocab, gaussian, spm_vocab, write_out

ARCHITECTURES = ("hy_v3", "step35")
SLIDING_WINDOW = 64


@dataclass(frozen=True)
class ChainModel:
    n_embd: int = 64
    n_layer: int = 2          # trunk layers; the heads come after them
    n_heads_mtp: int = 3      # nextn_predict_layers: the chained heads
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx: int = 1024
    seed: int = 0
    residual: float = 0.3     # the trunk layers' weight against the token embedding
    head_noise: float = 0.3   # the heads' weight on the hidden state, attention and FFN
    logit_scale: float = 1.0
    architecture: str = "hy_v3"

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must be a multiple of n_head, and n_head of n_head_kv")
        if self.n_heads_mtp < 1:
            raise ValueError("a chained target has at least one head")
        if self.residual < 0 or self.head_noise < 0:
            raise ValueError("residual and head_noise must be >= 0")


def _add_block(w: gguf.GGUFWriter, i: int, weight: Weight, model: ChainModel, head: bool) -> None:
    """Block i: q/k-normed attention and a dense FFN, their outputs scaled by `residual` in the trunk and by
    `head_noise` in a head, which also gets its NextN projection."""
    d, hd, n_kv = model.n_embd, model.n_embd // model.n_head, model.n_head_kv
    sd, scale = 1.0 / np.sqrt(d), model.head_noise if head else model.residual
    norms = {"attn_norm": d, "attn_q_norm": hd, "attn_k_norm": hd, "ffn_norm": d}
    for name, n in norms.items():
        w.add_tensor(f"blk.{i}.{name}.weight", np.ones(n, dtype=np.float32))
    for name, rows in (("attn_q", d), ("attn_k", hd * n_kv), ("attn_v", hd * n_kv)):
        w.add_tensor(f"blk.{i}.{name}.weight", weight((rows, d), sd))
    w.add_tensor(f"blk.{i}.attn_output.weight", weight((d, d), sd * scale))
    add_ffn(w, i, weight, d, model.n_ff, scale)
    if head:
        add_nextn_tensors(w, i, weight((d, d), sd * model.head_noise))


def write_chained_mtp_target(path: Path, model: ChainModel = ChainModel(), vocab: Vocab | None = None) -> Path:
    """Write a hy_v3 or step35 GGUF: `model.n_layer` dense trunk layers and `model.n_heads_mtp` NextN (MTP)
    blocks."""
    vocab = vocab or spm_vocab()
    rng = np.random.default_rng(model.seed)
    n_vocab, d, f = len(vocab.tokens), model.n_embd, model.n_ff
    n_all = model.n_layer + model.n_heads_mtp
    weight = gaussian(rng)
    w = gguf.GGUFWriter(str(path), model.architecture)
    w.add_name("tiny-chained-mtp-test")
    w.add_context_length(model.n_ctx)
    w.add_embedding_length(d)
    w.add_block_count(n_all)
    w.add_nextn_predict_layers(model.n_heads_mtp)
    w.add_feed_forward_length(f)
    w.add_expert_feed_forward_length(f)  # required by both loaders; no block has experts
    if model.architecture == "step35":
        w.add_sliding_window(SLIDING_WINDOW)
        w.add_sliding_window_pattern([i == 0 or i == n_all - 1 for i in range(n_all)])
    w.add_head_count(model.n_head)
    w.add_head_count_kv(model.n_head_kv)
    w.add_rope_dimension_count(d // model.n_head)  # hy_v3 rotates the whole head, step35 half of it outside the window
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_vocab(w, vocab)

    w.add_tensor("token_embd.weight", weight((n_vocab, d), 1.0))
    for i in range(n_all):
        _add_block(w, i, weight, model, head=i >= model.n_layer)
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    w.add_tensor("output.weight", weight((n_vocab, d), model.logit_scale))

    write_out(w)
    return path
