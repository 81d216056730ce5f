"""What drafters a GGUF file carries in itself, read from its header alone (no llama.cpp).

In 2026 many models ship their own drafter: MTP (multi-token prediction, NextN)
layers after the trunk, counted by `{arch}.nextn_predict_layers` (Qwen3.5/3.6,
GLM-4.5 and later, DeepSeek V3/V4, Step 3.5, ...); or a one-layer EAGLE-3
draft in a file of its own (architecture `eagle3`), which reads three of the
target's layers (`eagle3.target_layers`, `eagle3.target_hidden_size`) and may
propose from a reduced vocabulary mapped back by its `d2t` tensor
(docs/eagle3-protocol.md); or a DFlash / DSpark block draft (architecture
`dflash`), which reads any number of the target's layers into its own KV cache
and proposes a whole chain from one decode of `[last token, <mask> x k]`
(docs/dflash-protocol.md); or Gemma 4's assistant (architecture
`gemma4-assistant`, docs/gemma4-assistant.md), MTP blocks in a file of their own
that read the target's KV cells and hidden rows. llama.cpp 0.3.36 runs MTP heads
for the architectures whose graph has an MTP form (src/models/*.cpp, those
whose build_arch_graph handles LLM_GRAPH_TYPE_DECODER_MTP), several of them
chained for three (`CHAINED_MTP_ARCHITECTURES`); GLM-4 keeps the
tensors "preserved but unused", so a file of another architecture is run
without its head rather than asked for a graph llama.cpp lacks.
"""

from __future__ import annotations

from models.gguf_info import GGUFInfo

# glm5-next is not one: its build_arch_graph throws for the MTP graph ("GLM5-Next NextN graph not implemented
# yet", src/models/glm5-next.cpp:189-191).
MTP_ARCHITECTURES = frozenset({
    "glm4moe", "glm-dsa", "deepseek2", "deepseek32", "deepseek4", "qwen35", "qwen35moe",
    "qwen3next", "step35", "mimo2", "hy_v3", "nemotron_h_moe", "bailingmoe3", "cohere2moe",
})

# The architectures whose MTP graph runs any of several NextN blocks, picked per decode by
# llama_set_nextn_layer_offset (src/models/step35.cpp:376, mimo2.cpp:276, hy-v3.cpp:245): with more than one,
# llama.cpp chains them, draft k by head k (common/speculative.cpp, `chain_heads`; backends.mtp_chain). The
# others' MTP graph asserts a single block (e.g. src/models/qwen35.cpp:489): llama.cpp would abort on a file of
# theirs with several, so such a file is not drafted with.
CHAINED_MTP_ARCHITECTURES = frozenset({"step35", "mimo2", "hy_v3"})


def mtp_heads(info: GGUFInfo) -> int:
    """The MTP layers of a file that specchat can draft with (0: none, or an architecture llama.cpp cannot run
    them for, or as many of them)."""
    if info.architecture not in MTP_ARCHITECTURES:
        return 0
    if info.nextn_layers > 1 and info.architecture not in CHAINED_MTP_ARCHITECTURES:
        return 0
    return info.nextn_layers


def mtp_chained(info: GGUFInfo) -> bool:
    """Whether the file's MTP heads are chained (draft k by head k, at most one draft per head a step)."""
    return mtp_heads(info) > 1


def eagle3_problems(target: GGUFInfo, draft: GGUFInfo) -> list[str]:
    """Why an EAGLE-3 draft cannot read this target (its layers and hidden size), in words; [] when it can."""
    problems = []
    if len(draft.eagle3_layers) != 3:
        problems.append(f"an EAGLE-3 draft reads 3 target layers, this one names {len(draft.eagle3_layers)}")
    n_layer = (target.block_count or 0) - target.nextn_layers  # the trunk: an MTP head's layers come after it
    too_deep = [i for i in draft.eagle3_layers if not 0 <= i <= n_layer]
    if too_deep:
        problems.append(f"it reads layers {too_deep}, the target has {n_layer}")
    if draft.eagle3_hidden is not None and target.embedding_length is not None \
            and draft.eagle3_hidden != target.embedding_length:
        problems.append(f"it reads hidden states of {draft.eagle3_hidden}, the target's are {target.embedding_length}")
    return problems


def dflash_problems(target: GGUFInfo, draft: GGUFInfo) -> list[str]:
    """Why a DFlash block draft cannot draft for this target, from the headers (docs/dflash-protocol.md); [] when
    it can."""
    problems = []
    if not draft.dflash_layers:
        problems.append("a DFlash draft names the target layers it reads (dflash.target_layers), this one none")
    n_layer = (target.block_count or 0) - target.nextn_layers
    too_deep = [i for i in draft.dflash_layers if not 0 <= i < n_layer]
    if too_deep:
        problems.append(f"it reads layers {too_deep}, the target has {n_layer}")
    if draft.embedding_length is not None and target.embedding_length is not None \
            and draft.embedding_length != target.embedding_length:
        problems.append(f"its hidden size is {draft.embedding_length}, the target's {target.embedding_length} "
                        "(llama.cpp injects the target's layers at the draft's width)")
    if draft.mask_id is None or not 0 <= draft.mask_id < draft.vocab_size:
        problems.append("it names no mask token (tokenizer.ggml.mask_token_id), which its blocks are made of")
    if draft.dflash_kind == "dflash2":
        problems.append("it is a DFlash2 draft (a selector lattice: a greedy walk with no distribution to verify "
                        "against), which specchat does not run")
    return problems


def assistant_problems(target: GGUFInfo, draft: GGUFInfo) -> list[str]:
    """Why a Gemma 4 assistant cannot draft for this target, from the headers (docs/gemma4-assistant.md); [] when it
    can. It reads the target's token embeddings, hidden rows and KV cells: llama.cpp checks none of it against the
    target and would read out of bounds (src/models/gemma4-assistant.cpp:103-114)."""
    problems = []
    if target.architecture != "gemma4":
        problems.append(f"a Gemma 4 assistant drafts for a gemma4 target, this one is {target.architecture}")
    if draft.embedding_length_out is None:
        problems.append("it names no target hidden size (gemma4-assistant.embedding_length_out)")
    elif target.embedding_length is not None and draft.embedding_length_out != target.embedding_length:
        problems.append(f"it reads hidden states of {draft.embedding_length_out}, the target's are "
                        f"{target.embedding_length}")
    if draft.vocab_size != target.vocab_size:
        problems.append(f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}")
    if target.architecture == "gemma4":
        problems += _assistant_layout_problems(target, draft)
    return problems


def _assistant_layout_problems(target: GGUFInfo, draft: GGUFInfo) -> list[str]:
    """Where the assistant's blocks would read the target's KV cells with another layout than the target wrote
    them in (docs/gemma4-assistant.md, "What a pair must share"). Each sliding-window block reads the cache of
    the target's layer n_layer - 2, each full block that of layer n_layer - 1 (src/llama-model.cpp:2812-2820),
    looked up among the target's sliding-window or full layers by the block's own kind
    (src/llama-kv-cache-iswa.cpp:53-66, 85-105; src/llama-kv-cache.cpp:176-180), and viewed as the block's
    own KV heads of its own head size over the target layer's rows (get_k / get_v,
    src/llama-kv-cache.cpp:1276-1318; the width check there is a debug-only assert)."""
    n_layer = target.block_count or 0
    if n_layer < 2 or not draft.swa_pattern:
        return []  # llama.cpp refuses an assistant without the pattern itself (gemma4-assistant.cpp:7)
    problems = []
    for slides in (True, False):
        blocks = [i for i, s in enumerate(draft.swa_pattern) if s == slides]
        if not blocks:
            continue
        layer = n_layer - 2 if slides else n_layer - 1
        kind = "sliding-window" if slides else "full"
        t_slides, t_heads, t_size = target.kv_layout(layer)
        if target.swa_pattern and t_slides != slides:
            problems.append(f"its {kind} blocks read the target's layer {layer}, which is "
                            f"{'a full' if slides else 'a sliding-window'} layer (attention.sliding_window_pattern)")
            continue
        heads = sorted({h for h in (draft.kv_layout(i)[1] for i in blocks) if h is not None and h != t_heads})
        if heads and t_heads is not None:
            problems.append(f"its {kind} blocks read the target's layer {layer} as {'/'.join(map(str, heads))} KV "
                            f"head{'s' if heads != [1] else ''}, the layer has {t_heads} (attention.head_count_kv)")
        size = draft.kv_layout(blocks[0])[2]
        if size is not None and t_size is not None and size != t_size:
            key = "attention.key_length_swa" if slides else "attention.key_length"
            problems.append(f"its {kind} blocks read the target's layer {layer} in KV heads of {size}, the "
                            f"layer's are of {t_size} ({key})")
    return problems


def describe_drafters(info: GGUFInfo) -> str:
    """One line on the drafters a file carries (or is), for `models info` and the chat app."""
    if info.architecture == "eagle3":
        vocab = f"{info.draft_vocab} of the target's {info.vocab_size} tokens" if info.draft_vocab \
            else f"the target's {info.vocab_size} tokens"
        return (f"EAGLE-3 draft for target layers {list(info.eagle3_layers)}, hidden size {info.eagle3_hidden}, "
                f"proposing from {vocab}")
    if info.architecture == "gemma4-assistant":
        return (f"Gemma 4 assistant (MTP) for a gemma4 target of hidden size {info.embedding_length_out}: "
                f"{info.nextn_layers or info.block_count} block(s) reading the target's KV cells, drafting with -md")
    if info.architecture == "dflash":
        name = {"dspark": "DSpark", "dflash2": "DFlash2"}.get(info.dflash_kind, "DFlash")
        drafts = info.dflash_block if info.dflash_anchor_first else info.dflash_block - 1
        return (f"{name} draft for target layers {list(info.dflash_layers)}, blocks of {info.dflash_block} "
                f"(up to {drafts} drafts from one decode)")
    if info.nextn_layers and info.architecture not in MTP_ARCHITECTURES:
        return (f"{info.nextn_layers} MTP layer(s), which llama.cpp 0.3.36 does not run for the "
                f"{info.architecture} architecture")
    if info.nextn_layers and not mtp_heads(info):
        return (f"{info.nextn_layers} MTP layers, which llama.cpp 0.3.36 does not run: its {info.architecture} "
                "MTP graph takes a single head")
    if mtp_chained(info):
        return (f"MTP heads: {info.nextn_layers}, chained (draft k by head k, up to {info.nextn_layers} drafts a "
                "step; drafts without a draft model)")
    if info.nextn_layers:
        return f"MTP heads: {info.nextn_layers} (drafts without a draft model)"
    return "none"


# Architectures whose memory keeps a recurrent state (or another state without per-position cells) that llama.cpp
# 0.3.36 can roll back only from per-token snapshots, n_rs_seq of them per sequence (src/llama-arch.cpp,
# llm_arch_supports_rs_rollback): Qwen3.5/3.6's gated delta-net layers, Nemotron-H, LFM2, ... Speculation on
# them needs the snapshots (a rejected draft is undone from one), and one sequence id per slot: a state is
# copied whole between ids, so trees and lookahead's window would multiply it.
RS_ROLLBACK_ARCHITECTURES = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
    "lfm2", "lfm2moe", "bailingmoe3",
})
