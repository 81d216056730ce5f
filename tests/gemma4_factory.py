"""A tiny Gemma 4 target and its "assistant" (architecture `gemma4-assistant`), written with `gguf.GGUFWriter`.

Gemma 4 ships its MTP drafter as a separate GGUF (convert_hf_to_gguf's
Gemma4AssistantModel, conversion/gemma.py:935-951): a few decoder blocks of
their own width (`embedding_length`) reading hidden rows of the target's
width (`embedding_length_out`, the "backbone"), `nextn_predict_layers` =
block count. llama.cpp 0.3.36 builds it in src/models/gemma4-assistant.cpp:
  - input: the *target's* token embedding of the row's token, scaled by
    sqrt(D) (D the target's width), concatenated with a hidden row h of the
    target's width, projected by `nextn.pre_projection` {2D, n_embd} (:105-114);
  - each block: attention with a query only (`attn_q`, `attn_q_norm`,
    `attn_output`), which reads the target's KV cells of its last sliding-window
    layer (n_layer - 2) or its last full layer (n_layer - 1)
    (src/llama-model.cpp:2809-2836), then Gemma's post-attention norm, a GELU
    FFN and its post norm, and `layer_output_scale` (:121-182);
  - output: the assistant's own `token_embd` as a tied LM head (:29-30), and
    h_next = `nextn.post_projection` {n_embd, D} of the normed state, fed back
    as the next draft row's h (:190-193).
llama.cpp refuses an assistant whose embedding_length_out equals its own
width (:27-29), so the two widths differ here too.

The target is `gemma4` (src/models/gemma4.cpp) without per-layer embeddings
or experts: two layers, the first sliding-window and the last full (the
assistant mirrors these two), the full one with `rope_freqs`. Its hidden row
for the assistant is the post-output-norm state (gemma4.cpp:408-415).

Agreement is tunable as in the other factories: the target's attention and
FFN outputs go through post norms whose weights are `residual` (at 0 its next
token is f(t) = argmax output · rms(embedding(t))); the assistant's
pre-projection passes the token half through to the first D of its
n_embd > D dims and mixes h in at `head_noise`, its blocks' post norms are
`head_noise`, and its LM head is the target's output rows padded with zeros,
so at head_noise 0 a draft row (t, h) predicts f(t).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from gguf_factory import Vocab, add_vocab, gaussian, spm_vocab, write_out

TARGET_ARCH = "gemma4"
ASSISTANT_ARCH = "gemma4-assistant"


@dataclass(frozen=True)
class Gemma4Pair:
    n_embd: int = 64              # the target's width (the assistant's embedding_length_out)
    n_embd_assistant: int = 96    # the assistant's own width: llama.cpp refuses it equal to the target's
    n_layer: int = 2              # target layers: sliding-window ones, the last full
    n_assistant_layers: int = 2   # the assistant's blocks (nextn_predict_layers): [swa, full]
    n_head: int = 2
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff: int = 128
    n_ctx: int = 1024
    sliding_window: int = 64
    residual: float = 0.3
    head_noise: float = 0.3
    logit_scale: float = 1.0
    swa_pattern: tuple[bool, ...] | None = None  # which layers slide; None: every one but the last

    def __post_init__(self) -> None:
        if self.n_embd_assistant <= self.n_embd:
            raise ValueError("the assistant's width must exceed the target's (its token half is passed through)")
        if self.n_layer < 2 or self.n_assistant_layers < 1:
            raise ValueError("the target needs 2 layers (one sliding-window, the last full), the assistant one")
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")
        if self.residual < 0 or self.head_noise < 0:
            raise ValueError("residual and head_noise must be >= 0")

    def pattern(self, n: int) -> list[bool]:
        return list(self.swa_pattern) if self.swa_pattern is not None else _swa_pattern(n)


def _swa_pattern(n: int) -> list[bool]:
    """Every layer sliding-window but the last (Gemma 4's pattern ends with a full layer)."""
    return [i < n - 1 for i in range(n)]


def _header(w: gguf.GGUFWriter, arch: str, m: Gemma4Pair, n_embd: int, n_layer: int) -> None:
    w.add_context_length(m.n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(m.n_ff)
    w.add_head_count(m.n_head)
    w.add_head_count_kv(m.n_head_kv)
    w.add_key_length(m.head_dim)
    w.add_value_length(m.head_dim)
    w.add_uint32(f"{arch}.attention.key_length_swa", m.head_dim)
    w.add_uint32(f"{arch}.attention.value_length_swa", m.head_dim)
    w.add_rope_dimension_count(m.head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count_swa", m.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(m.sliding_window)
    w.add_array(f"{arch}.attention.sliding_window_pattern", m.pattern(n_layer))
    w.add_uint32(f"{arch}.attention.shared_kv_layers", 0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def write_gemma4_pair(target_path: str | Path, assistant_path: str | Path, seed: int = 0,
                      model: Gemma4Pair = Gemma4Pair(), vocab: Vocab | None = None,
                      backbone: int | None = None, assistant: Gemma4Pair | None = None) -> tuple[Path, Path]:
    """Write a gemma4 target and a gemma4-assistant for it (same tokenizer). `backbone` overrides the assistant's
    embedding_length_out key alone (an assistant built for another target width: for tests of its refusal);
    `assistant` gives the assistant's own attention (heads, KV heads, head size, layer pattern) where it should
    differ from `model`'s (an assistant built for another target's layers; its widths and weights stay
    `model`'s)."""
    m = model
    vocab = vocab or spm_vocab()
    rng = np.random.default_rng(seed)
    rand = gaussian(rng)
    n_vocab, d, a, f = len(vocab.tokens), m.n_embd, m.n_embd_assistant, m.n_ff
    q_dim, kv_dim = m.n_head * m.head_dim, m.n_head_kv * m.head_dim
    ones = np.ones(d, dtype=np.float32)
    rope_freqs = np.ones(m.head_dim // 2, dtype=np.float32)

    # --- target: gemma4 (numpy shapes are ggml's reversed: (rows = output width, input width))
    embd = rand((n_vocab, d), 1.0 / np.sqrt(d))  # scaled by sqrt(D) in the graph: rows of rms 1
    out = rand((n_vocab, d), m.logit_scale)
    w = gguf.GGUFWriter(str(target_path), TARGET_ARCH)
    w.add_name("tiny-gemma4-target")
    _header(w, TARGET_ARCH, m, d, m.n_layer)
    w.add_uint32(f"{TARGET_ARCH}.embedding_length_per_layer_input", 0)  # no per-layer embeddings
    add_vocab(w, vocab)
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("rope_freqs.weight", rope_freqs)  # the full layers' proportional RoPE: all dims rotated here
    post = np.full(d, m.residual, dtype=np.float32)
    for i in range(m.n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", rand((q_dim, d), 1.0 / np.sqrt(d)))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand((kv_dim, d), 1.0 / np.sqrt(d)))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand((kv_dim, d), 1.0 / np.sqrt(d)))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand((d, q_dim), 1.0 / np.sqrt(q_dim)))
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(m.head_dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(m.head_dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", post)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand((f, d), 1.0 / np.sqrt(d)))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand((f, d), 1.0 / np.sqrt(d)))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand((d, f), 1.0 / np.sqrt(f)))
        w.add_tensor(f"blk.{i}.post_ffw_norm.weight", post)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", out)
    write_out(w)

    # --- assistant: gemma4-assistant, width a > d
    arch = ASSISTANT_ARCH
    na = m.n_assistant_layers
    ma = assistant or m
    q_dim, rope_freqs = ma.n_head * ma.head_dim, np.ones(ma.head_dim // 2, dtype=np.float32)
    w = gguf.GGUFWriter(str(assistant_path), arch)
    w.add_name("tiny-gemma4-assistant")
    _header(w, arch, replace(ma, n_ctx=m.n_ctx, n_ff=m.n_ff, sliding_window=m.sliding_window), a, na)
    w.add_uint32(f"{arch}.embedding_length_out", d if backbone is None else backbone)
    w.add_uint32(f"{arch}.nextn_predict_layers", na)
    add_vocab(w, vocab)
    head = np.zeros((n_vocab, a), dtype=np.float32)
    head[:, :d] = out  # the LM head (tied to token_embd): the target's output rows on the token half
    w.add_tensor("token_embd.weight", head)
    w.add_tensor("output_norm.weight", np.ones(a, dtype=np.float32))
    pre = np.zeros((a, 2 * d), dtype=np.float32)  # {2D, a}: [x ; h] -> a
    pre[:d, :d] = np.eye(d, dtype=np.float32)
    pre[:, d:] = rand((a, d), m.head_noise / np.sqrt(d))
    w.add_tensor("nextn.pre_projection.weight", pre)
    post_proj = np.zeros((d, a), dtype=np.float32)  # {a, D}: h_next, the token half of the normed state
    post_proj[:, :d] = np.eye(d, dtype=np.float32)
    w.add_tensor("nextn.post_projection.weight", post_proj)
    w.add_tensor("rope_freqs.weight", rope_freqs)
    noise = np.full(a, m.head_noise, dtype=np.float32)
    for i in range(na):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(a, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand((q_dim, a), 1.0 / np.sqrt(a)))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand((a, q_dim), 1.0 / np.sqrt(q_dim)))
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(ma.head_dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", noise)
        w.add_tensor(f"blk.{i}.layer_output_scale.weight", np.ones(1, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(a, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand((f, a), 1.0 / np.sqrt(a)))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand((f, a), 1.0 / np.sqrt(a)))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand((a, f), 1.0 / np.sqrt(f)))
        w.add_tensor(f"blk.{i}.post_ffw_norm.weight", noise)
    write_out(w)
    return Path(target_path), Path(assistant_path)
