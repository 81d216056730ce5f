"""What drafters a GGUF file carries in itself, read from its header alone (no llama.cpp).

In 2026 many models ship their own drafter: MTP (multi-token prediction, NextN)
layers after the trunk, counted by `{arch}.nextn_predict_layers` (Qwen3.5/3.6,
GLM-4.5 and later, DeepSeek V3/V4, Step 3.5, ...). llama.cpp 0.3.36 runs them
for the architectures whose graph has an MTP form (src/models/*.cpp, those
whose build_arch_graph handles LLM_GRAPH_TYPE_DECODER_MTP); GLM-4 keeps the
tensors "preserved but unused", so a file of another architecture is run
without its head rather than asked for a graph llama.cpp lacks.
"""

from __future__ import annotations

from models.gguf_info import GGUFInfo

MTP_ARCHITECTURES = frozenset({
    "glm4moe", "glm-dsa", "glm5-next", "deepseek2", "deepseek32", "deepseek4", "qwen35", "qwen35moe",
    "qwen3next", "step35", "mimo2", "hy_v3", "nemotron_h_moe", "bailingmoe3", "cohere2moe",
})


def mtp_heads(info: GGUFInfo) -> int:
    """The MTP layers of a file that specchat can draft with (0: none, or an architecture llama.cpp cannot run
    them for)."""
    return info.nextn_layers if info.architecture in MTP_ARCHITECTURES else 0


def describe_drafters(info: GGUFInfo) -> str:
    """One line on the drafters a file carries, for `models info` and the chat app."""
    if info.nextn_layers and info.architecture not in MTP_ARCHITECTURES:
        return (f"{info.nextn_layers} MTP layer(s), which llama.cpp 0.3.36 does not run for the "
                f"{info.architecture} architecture")
    if info.nextn_layers:
        return f"MTP heads: {info.nextn_layers} (drafts without a draft model)"
    return "none"
