"""A tiny Qwen3.5 (`qwen35`) target whose GGUF carries its own MTP head, written with `gguf.GGUFWriter`.

llama.cpp 0.3.36 runs Qwen3.5/3.6 dense (src/models/qwen35.cpp) as a hybrid
trunk: gated delta-net linear-attention layers (recurrent: a conv state and
an SSM state per sequence, no KV cells) with a gated full-attention layer
every `full_attention_interval` layers, then one MTP (NextN) block shaped like
a full-attention layer (`qwen35.nextn_predict_layers` = 1). A plain context
runs the trunk and skips the block; a context of type MTP runs only the block
(`graph_mtp`). Unlike tests/drafter_factory.py's glm4moe, the target's memory
is recurrent, so a rejected draft cannot be cut off its cells: llama.cpp
rolls the recurrent state back from per-token snapshots
(`llm_arch_supports_rs_rollback`, `n_rs_seq`), see docs/qwen35-fixture.md.

The layout mirrors a converted Qwen3.5 (conversion/qwen.py): per linear layer
attn_qkv (the conv's q, k, v channels), attn_gate (z), ssm_conv1d,
ssm_dt.bias, ssm_a (= -exp(A_log), negative), ssm_beta, ssm_alpha, ssm_norm,
ssm_out; per attention layer attn_q of twice the heads' width (query and
output gate interleaved per head), attn_k, attn_v, attn_q_norm, attn_k_norm,
attn_output; every layer attn_norm, post_attention_norm and a SwiGLU FFN;
head_dim set by attention.key_length (not n_embd / n_head), partial rotary
(rope.dimension_count = head_dim / 4) with interleaved M-RoPE sections; fewer
key heads (ssm.group_count) than value heads (ssm.time_step_rank), as in the
real models. F32 weights, so llama.cpp loads it in milliseconds.

Agreement is tunable as in tests/drafter_factory.py:
  - The trunk's output projections (ssm_out, attn_output, ffn_down) are
    scaled by `residual`: at 0 every layer adds nothing, and the target's
    logits at x_t are output · norm(embedding(x_t)).
  - The head's eh_proj passes the (normed) token embedding through and scales
    the target's hidden state by `head_noise`, its attn_output and ffn_down
    by the same; it shares the target's output head. At head_noise 0 its row
    (x_p, h_{p-1}) gives output · norm(embedding(x_p)): what a residual-free
    target predicts after x_p, so with residual = head_noise = 0 every draft
    is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from drafter_factory import add_nextn_tensors
from gguf_factory import Vocab, add_ffn, add_vocab, gaussian, spm_vocab, write_out

ARCH = "qwen35"


@dataclass(frozen=True)
class Qwen35Model:
    n_embd: int = 64
    n_layer: int = 4                 # trunk layers; the NextN block is one more
    full_attention_interval: int = 4  # layer i is full attention when (i + 1) % interval == 0
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32               # attention.key_length = value_length
    n_rot: int = 8                   # partial rotary, as Qwen3.5's 0.25
    rope_sections: tuple[int, int, int, int] = (2, 1, 1, 0)  # sum = n_rot / 2 (Qwen3.5: 11, 11, 10, 0 of 32)
    n_ff: int = 128
    ssm_conv_kernel: int = 4
    ssm_state: int = 16              # head_k_dim = head_v_dim
    ssm_k_heads: int = 2             # ssm.group_count
    ssm_v_heads: int = 4             # ssm.time_step_rank; inner_size = state * v_heads
    n_ctx: int = 1024
    seed: int = 0
    residual: float = 0.3            # the trunk layers' weight against the token embedding
    head_noise: float = 0.3          # the head's weight on the hidden state, attention and FFN
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")
        if self.ssm_v_heads % self.ssm_k_heads:
            raise ValueError("ssm_v_heads must be a multiple of ssm_k_heads")
        if 2 * sum(self.rope_sections) != self.n_rot or self.n_rot > self.head_dim:
            raise ValueError("rope_sections must sum to n_rot / 2, and n_rot be <= head_dim")
        if self.full_attention_interval < 1:
            raise ValueError("full_attention_interval must be >= 1")
        if self.residual < 0 or self.head_noise < 0:
            raise ValueError("residual and head_noise must be >= 0")

    @property
    def ssm_inner(self) -> int:
        return self.ssm_state * self.ssm_v_heads

    def is_recurrent(self, il: int) -> bool:
        """llama.cpp's default when the file has no attention.recurrent_layers (qwen35.cpp load_arch_hparams)."""
        return il < self.n_layer and (il + 1) % self.full_attention_interval != 0


def write_qwen35_mtp_target(path: Path, model: Qwen35Model = Qwen35Model(), vocab: Vocab | None = None) -> Path:
    """Write a qwen35 GGUF: `model.n_layer` hybrid trunk layers and one NextN (MTP) block."""
    vocab = vocab or spm_vocab()
    rng = np.random.default_rng(model.seed)
    n_vocab, d, f = len(vocab.tokens), model.n_embd, model.n_ff
    hd, nh, nkv = model.head_dim, model.n_head, model.n_head_kv
    key_dim = model.ssm_state * model.ssm_k_heads
    value_dim = model.ssm_inner
    conv_dim = 2 * key_dim + value_dim
    n_all = model.n_layer + 1

    weight = gaussian(rng)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny-qwen35-mtp-test")
    w.add_context_length(model.n_ctx)
    w.add_embedding_length(d)
    w.add_block_count(n_all)
    w.add_nextn_predict_layers(1)
    w.add_feed_forward_length(f)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(model.n_rot)
    w.add_rope_dimension_sections(list(model.rope_sections))
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_ssm_conv_kernel(model.ssm_conv_kernel)
    w.add_ssm_state_size(model.ssm_state)
    w.add_ssm_group_count(model.ssm_k_heads)
    w.add_ssm_time_step_rank(model.ssm_v_heads)
    w.add_ssm_inner_size(value_dim)
    w.add_full_attention_interval(model.full_attention_interval)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_vocab(w, vocab)

    sd = 1.0 / np.sqrt(d)

    def attention(i: int, out_scale: float) -> None:
        """Gated full attention: Q is [query | gate] per head (2 * head_dim each), q/k RMS-normed per head."""
        w.add_tensor(f"blk.{i}.attn_q.weight", weight((2 * hd * nh, d), sd))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight((hd * nkv, d), sd))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight((hd * nkv, d), sd))
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", ones(hd))
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", ones(hd))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight((d, hd * nh), out_scale / np.sqrt(hd * nh)))

    w.add_tensor("token_embd.weight", weight((n_vocab, d), 1.0))
    for i in range(n_all):
        trunk = i < model.n_layer
        out_scale = model.residual if trunk else model.head_noise
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(d))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", ones(d))
        if model.is_recurrent(i):
            # Gated delta net. numpy shapes are ggml's ne reversed: ssm_conv1d is ne {d_conv, conv_dim}.
            w.add_tensor(f"blk.{i}.attn_qkv.weight", weight((conv_dim, d), sd))
            w.add_tensor(f"blk.{i}.attn_gate.weight", weight((value_dim, d), sd))
            w.add_tensor(f"blk.{i}.ssm_conv1d.weight",
                         weight((conv_dim, model.ssm_conv_kernel), 1.0 / np.sqrt(model.ssm_conv_kernel)))
            w.add_tensor(f"blk.{i}.ssm_dt.bias", ones(model.ssm_v_heads))
            # A = -exp(A_log), A_log ~ U(log 0.5, log 4): decays exp(A * softplus(.)) in a sane range.
            a_log = rng.uniform(np.log(0.5), np.log(4.0), size=model.ssm_v_heads)
            w.add_tensor(f"blk.{i}.ssm_a", (-np.exp(a_log)).astype(np.float32))
            w.add_tensor(f"blk.{i}.ssm_beta.weight", weight((model.ssm_v_heads, d), sd))
            w.add_tensor(f"blk.{i}.ssm_alpha.weight", weight((model.ssm_v_heads, d), sd))
            w.add_tensor(f"blk.{i}.ssm_norm.weight", ones(model.ssm_state))
            w.add_tensor(f"blk.{i}.ssm_out.weight", weight((d, value_dim), out_scale / np.sqrt(value_dim)))
        else:
            attention(i, out_scale)
        add_ffn(w, i, weight, d, f, out_scale)
        if trunk:
            continue
        add_nextn_tensors(w, i, weight((d, d), sd * model.head_noise))
    w.add_tensor("output_norm.weight", ones(d))
    w.add_tensor("output.weight", weight((n_vocab, d), model.logit_scale))

    write_out(w)
    return path
