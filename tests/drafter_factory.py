"""A tiny target whose GGUF carries its own MTP (multi-token prediction) head, written with `gguf.GGUFWriter`.

The architecture is `glm4moe` (GLM-4.5's), the simplest one llama.cpp 0.3.36
runs an MTP head for with plain attention (src/models/glm4-moe.cpp,
`graph_mtp`): Qwen3.5's trunk is recurrent, DeepSeek's uses MLA. The trunk's
layers are dense (`leading_dense_block_count` = the trunk), the one NextN
block after them is an MoE layer, as in GLM-4.5. `nextn_predict_layers` = 1
tells llama.cpp the last block is the head: a plain context skips it, a
context of type MTP runs only it.

Random weights give a head that agrees with the target by chance only; so
the weights are built to make agreement tunable:
  - The trunk's attention and FFN outputs are scaled by `residual`: at 0 the
    target's next token is a function of the current one alone (its logits
    are output · norm(embedding)), at 1 the layers weigh as much as usual.
  - The head's eh_proj passes the token embedding through and scales the
    target's hidden state by `head_noise`, its attention and experts by the
    same; it shares the target's output head. At `head_noise` 0 it predicts
    from token x_{t+1} exactly what a residual-free target predicts from it,
    so with a small `residual` most of its drafts are accepted, and at large
    values few are: the tests cover both the accepting and the rejecting paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from gguf_factory import Vocab, add_attention, add_ffn, add_vocab, gaussian, spm_vocab, write_out


@dataclass(frozen=True)
class MtpModel:
    n_embd: int = 64
    n_layer: int = 2          # trunk layers; the NextN block is one more
    n_head: int = 4
    n_ff: int = 128
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_ctx: int = 1024
    seed: int = 0
    residual: float = 0.3     # the trunk layers' weight against the token embedding
    head_noise: float = 0.3   # the head's weight on the hidden state, attention and experts
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError("n_embd must be a multiple of n_head")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError("n_expert_used must be in [1, n_expert]")
        if self.residual < 0 or self.head_noise < 0:
            raise ValueError("residual and head_noise must be >= 0")


def add_nextn_tensors(w: gguf.GGUFWriter, i: int, hidden_half: np.ndarray) -> None:
    """Block i's NextN tensors: eh_proj maps concat(enorm(embedding), hnorm(hidden)) to n_embd, the identity on
    the embedding half and `hidden_half` (n_embd x n_embd) on the hidden one; unit norms."""
    d = hidden_half.shape[0]
    eh = np.zeros((d, 2 * d), dtype=np.float32)
    eh[:, :d] = np.eye(d, dtype=np.float32)
    eh[:, d:] = hidden_half
    w.add_tensor(f"blk.{i}.nextn.eh_proj.weight", eh)
    for name in ("enorm", "hnorm", "shared_head_norm"):
        w.add_tensor(f"blk.{i}.nextn.{name}.weight", np.ones(d, dtype=np.float32))


def write_mtp_target(path: Path, model: MtpModel = MtpModel(), vocab: Vocab | None = None) -> Path:
    """Write a glm4moe GGUF with `model.n_layer` dense trunk layers and one NextN (MTP) block."""
    vocab = vocab or spm_vocab()
    rng = np.random.default_rng(model.seed)
    n_vocab, d, f, fe, ne = len(vocab.tokens), model.n_embd, model.n_ff, model.n_ff_exp, model.n_expert
    n_all = model.n_layer + 1
    head_dim = d // model.n_head

    weight = gaussian(rng)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_name("tiny-mtp-test")
    w.add_context_length(model.n_ctx)
    w.add_embedding_length(d)
    w.add_block_count(n_all)
    w.add_uint32("glm4moe.nextn_predict_layers", 1)
    w.add_feed_forward_length(f)
    w.add_head_count(model.n_head)
    w.add_head_count_kv(model.n_head)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(ne)
    w.add_expert_used_count(model.n_expert_used)
    w.add_expert_shared_count(1)
    w.add_expert_feed_forward_length(fe)
    w.add_leading_dense_block_count(model.n_layer)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(True)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_vocab(w, vocab)

    sd = 1.0 / np.sqrt(d)
    w.add_tensor("token_embd.weight", weight((n_vocab, d), 1.0))
    for i in range(n_all):
        trunk = i < model.n_layer
        out_scale = model.residual if trunk else model.head_noise
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(d))
        add_attention(w, i, weight, d, out_scale)
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", ones(d))
        if trunk:
            add_ffn(w, i, weight, d, f, out_scale)
            continue
        # The NextN block: an MoE layer (router, experts, one shared expert) after the MTP projection.
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", weight((ne, d), sd))
        w.add_tensor(f"blk.{i}.exp_probs_b.bias", np.zeros(ne, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", weight((ne, fe, d), sd))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", weight((ne, fe, d), sd))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", weight((ne, d, fe), out_scale / np.sqrt(fe)))
        w.add_tensor(f"blk.{i}.ffn_gate_shexp.weight", weight((fe, d), sd))
        w.add_tensor(f"blk.{i}.ffn_up_shexp.weight", weight((fe, d), sd))
        w.add_tensor(f"blk.{i}.ffn_down_shexp.weight", weight((d, fe), out_scale / np.sqrt(fe)))
        add_nextn_tensors(w, i, weight((d, d), sd * model.head_noise))
    w.add_tensor("output_norm.weight", ones(d))
    w.add_tensor("output.weight", weight((n_vocab, d), model.logit_scale))

    write_out(w)
    return path
