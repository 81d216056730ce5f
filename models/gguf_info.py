"""GGUF metadata and validation (GGUF spec:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md; header parsed by
models.gguf_header, type names from the `gguf` package).

llama.cpp trusts its input: a truncated file, tensor data past the end of the
file or a duplicated vocabulary entry can abort the whole process inside
llama.cpp (GGML_ASSERT). `validate_gguf` checks each of these
first and raises a `ModelError` with one clear line instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf

from models.errors import ModelError
from models.gguf_header import GGUFHeader, HeaderError, NeedMoreData, parse_header

# The architectures the `gguf` package names, and those llama.cpp 0c1e570 (vendored in llama-cpp-python
# 0.3.36, src/llama-arch.cpp) runs beyond them: 2026's models and drafters (EAGLE-3 and DFlash drafts, Gemma 4's
# assistant, DeepSeek V4, GLM-5 Next, ...), which a `gguf` release may not know yet.
_LLAMA_CPP_ARCHITECTURES = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek32", "deepseek4", "dflash", "dots3note", "eagle3", "gemma4-assistant",
    "glm5-next", "granite_swa", "graniteswitch", "hrm_text", "hy_v3", "hy_v4", "kimi-k3", "laguna", "maple",
    "mellum", "minimax-01", "minimax-m3", "muse-glimmer", "nanbeige", "pockettts", "qwen3tts", "qwen4exp",
    "spark2_5", "talkie",
})
_KNOWN_ARCHITECTURES = frozenset(gguf.MODEL_ARCH_NAMES.values()) | _LLAMA_CPP_ARCHITECTURES


@dataclass(frozen=True)
class GGUFInfo:
    """What specchat needs to know about a GGUF file before loading it."""

    path: Path
    size_bytes: int
    architecture: str
    name: str | None
    quantization: str | None
    n_params: int
    n_tensors: int
    context_length: int | None
    embedding_length: int | None
    block_count: int | None
    tokenizer_model: str | None
    tokens: tuple[str, ...]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None
    add_eos: bool | None
    chat_template: str | None
    # MTP (NextN) layers the file carries after its trunk (`{arch}.nextn_predict_layers`): a drafter of its own.
    nextn_layers: int = 0
    # An EAGLE-3 draft's target layers (`eagle3.target_layers`), the target's hidden size it reads
    # (`eagle3.target_hidden_size`) and its own reduced vocabulary (the rows of its `d2t` map; 0: the target's).
    eagle3_layers: tuple[int, ...] = ()
    eagle3_hidden: int | None = None
    draft_vocab: int = 0
    # A DFlash block draft's (architecture `dflash`, docs/dflash-protocol.md): the target layers whose inputs it
    # reads (`dflash.target_layers`), its trained block (`dflash.block_size`; llama.cpp takes 16 when absent), its
    # mask token (`tokenizer.ggml.mask_token_id`), its kind ("dflash"; "dspark" with a Markov head, "dflash2" with
    # a selector), whether a DSpark draft reads its drafts from the anchor's row on (`dflash.sample_from_anchor`,
    # default true) and whether its block attends causally (`dflash.attention.causal`, default false).
    dflash_layers: tuple[int, ...] = ()
    dflash_block: int = 16
    mask_id: int | None = None
    dflash_kind: str = ""
    dflash_anchor_first: bool = False
    dflash_causal: bool = False
    # The width of the hidden rows a Gemma 4 assistant reads and gives (`{arch}.embedding_length_out`: its
    # target's hidden size, conversion/gemma.py:950); None where the file does not say.
    embedding_length_out: int | None = None
    # The attention layout, as llama.cpp reads it (src/llama-model.cpp:1396-1404, 1436-1466): each layer's KV
    # heads (`{arch}.attention.head_count_kv`, one number or one a layer; `head_count`'s where absent), the head
    # size of full and of sliding-window layers (`attention.key_length`, default embedding_length / head_count;
    # `attention.key_length_swa`, default key_length) and which layers slide (`attention.sliding_window_pattern`;
    # () where the file has none). A Gemma 4 assistant reads its target's KV cells with its own layout
    # (models.drafters.assistant_problems).
    head_count_kv: tuple[int, ...] = ()
    key_length: int | None = None
    key_length_swa: int | None = None
    swa_pattern: tuple[bool, ...] = ()

    def kv_layout(self, layer: int) -> tuple[bool, int | None, int | None]:
        """(slides, KV heads, head size) of `layer`: what llama.cpp's KV views of it are made of
        (llama_hparams::n_head_kv, n_embd_head_k: src/llama-hparams.cpp:58-64, 140-146); None where unknown."""
        slides = bool(self.swa_pattern[layer]) if layer < len(self.swa_pattern) else False
        heads = self.head_count_kv[layer] if layer < len(self.head_count_kv) else None
        return slides, heads, self.key_length_swa if slides else self.key_length

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def summary(self) -> dict[str, Any]:
        """Everything but the vocabulary, for `models info` and logs."""
        return {
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "architecture": self.architecture,
            "name": self.name,
            "quantization": self.quantization,
            "n_params": self.n_params,
            "n_tensors": self.n_tensors,
            "context_length": self.context_length,
            "embedding_length": self.embedding_length,
            "block_count": self.block_count,
            "tokenizer_model": self.tokenizer_model,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "has_chat_template": self.chat_template is not None,
            "mtp_heads": self.nextn_layers,
            **({"eagle3_target_layers": list(self.eagle3_layers), "eagle3_target_hidden_size": self.eagle3_hidden,
                "draft_vocab_size": self.draft_vocab or self.vocab_size} if self.architecture == "eagle3" else {}),
            **({"dflash_target_layers": list(self.dflash_layers), "dflash_block_size": self.dflash_block,
                "dflash_kind": self.dflash_kind, "mask_token_id": self.mask_id,
                "draft_vocab_size": self.draft_vocab or self.vocab_size} if self.architecture == "dflash" else {}),
            **({"assistant_target_hidden_size": self.embedding_length_out}
               if self.architecture == "gemma4-assistant" else {}),
        }


def _quantization_name(file_type: Any) -> str | None:
    if file_type is None:
        return None
    try:
        name = gguf.LlamaFileType(int(file_type)).name
    except ValueError:
        return f"type {file_type}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _check_tensors(where: str, header: GGUFHeader, size: int) -> None:
    names: set[str] = set()
    for t in header.tensors:
        if t.name in names:
            raise ModelError(f"{where}: malformed GGUF: tensor {t.name} appears twice")
        names.add(t.name)
        end = header.data_offset + t.offset + t.n_bytes
        if end > size:
            raise ModelError(
                f"{where}: truncated GGUF: tensor {t.name} ends at byte {end} but the file has {size} bytes"
            )


def _check_vocab(where: str, tokens: tuple[str, ...]) -> None:
    """Every token unique as llama.cpp reads it: as a C string, up to its first NUL byte (two tokens that differ
    only after one are the same token to llama.cpp, whose vocabulary loader then aborts the process)."""
    read = [tok.split("\0", 1)[0] for tok in tokens]
    if len(set(read)) == len(read):
        return
    seen: dict[str, int] = {}
    for i, tok in enumerate(read):
        if tok in seen:
            why = "" if tokens[i] == tokens[seen[tok]] else " (llama.cpp reads a token only up to a NUL byte)"
            raise ModelError(
                f"{where}: malformed vocabulary: token {tok!r} appears twice (ids {seen[tok]} and {i}){why}"
            )
        seen[tok] = i


def _truthy(value: Any) -> bool:
    """A GGUF flag as common/speculative.cpp reads it (llama_model_meta_val_str, then strcmp with "true"): a bool
    true, or the string "true"; anything else is false."""
    return value is True or value == "true"


def _dflash_fields(meta: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    """A DFlash draft's fields of GGUFInfo, as common/speculative.cpp:980-997 and :2297-2300 read them."""
    kind = "dspark" if "markov_w1.weight" in tensors else "dflash2" if "selector_hidden.weight" in tensors \
        else "dflash"
    anchor = meta.get("dflash.sample_from_anchor")
    return {
        "dflash_layers": tuple(int(i) for i in meta.get("dflash.target_layers") or ()),
        "dflash_block": int(meta.get("dflash.block_size") or 16),
        "mask_id": meta.get("tokenizer.ggml.mask_token_id"),
        "dflash_kind": kind,
        "dflash_anchor_first": kind == "dspark" and (anchor is None or _truthy(anchor)),
        "dflash_causal": _truthy(meta.get("dflash.attention.causal")),
    }


def _per_layer(value: Any, n_layer: int) -> tuple[int, ...]:
    """A key llama.cpp reads with get_key_or_arr (src/llama-model-loader.cpp): one number for every layer, or
    one a layer."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),) * n_layer


def _attention_fields(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """The attention layout's fields of GGUFInfo, with llama.cpp's defaults (src/llama-model.cpp:1396-1466)."""
    n_layer = int(meta.get(f"{arch}.block_count") or 0)
    heads = _per_layer(meta.get(f"{arch}.attention.head_count"), n_layer)
    kv_heads = _per_layer(meta.get(f"{arch}.attention.head_count_kv"), n_layer) or heads
    n_embd = meta.get(f"{arch}.embedding_length")
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length is None and heads and heads[0] > 0 and n_embd:
        key_length = int(n_embd) // heads[0]
    key_length_swa = meta.get(f"{arch}.attention.key_length_swa")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    return {"head_count_kv": kv_heads, "key_length": key_length,
            "key_length_swa": key_length if key_length_swa is None else int(key_length_swa),
            "swa_pattern": tuple(bool(v) for v in pattern) if isinstance(pattern, list) else ()}


def info_from_header(path: Path, header: GGUFHeader, size: int) -> GGUFInfo:
    """Check a parsed header and describe the model. `size` is the whole file's size in bytes."""
    where = str(path)
    meta = header.metadata
    _check_tensors(where, header, size)
    arch = meta.get("general.architecture")
    if not arch:
        raise ModelError(f"{where}: GGUF has no general.architecture")
    if arch not in _KNOWN_ARCHITECTURES:
        raise ModelError(f"{where}: unknown model architecture {arch!r}")
    tokens = tuple(meta.get("tokenizer.ggml.tokens") or ())
    if not tokens:
        raise ModelError(f"{where}: GGUF has no vocabulary (tokenizer.ggml.tokens)")
    _check_vocab(where, tokens)

    def flag(key: str) -> bool | None:
        value = meta.get(key)
        return None if value is None else bool(value)

    return GGUFInfo(
        path=path,
        size_bytes=size,
        architecture=arch,
        name=meta.get("general.name"),
        quantization=_quantization_name(meta.get("general.file_type")),
        n_params=sum(t.n_elements for t in header.tensors),
        n_tensors=len(header.tensors),
        context_length=meta.get(f"{arch}.context_length"),
        embedding_length=meta.get(f"{arch}.embedding_length"),
        block_count=meta.get(f"{arch}.block_count"),
        tokenizer_model=meta.get("tokenizer.ggml.model"),
        tokens=tokens,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        add_bos=flag("tokenizer.ggml.add_bos_token"),
        add_eos=flag("tokenizer.ggml.add_eos_token"),
        chat_template=meta.get("tokenizer.chat_template"),
        nextn_layers=int(meta.get(f"{arch}.nextn_predict_layers") or 0),
        eagle3_layers=tuple(int(i) for i in meta.get("eagle3.target_layers") or ()),
        eagle3_hidden=meta.get("eagle3.target_hidden_size"),
        draft_vocab=next((t.n_elements for t in header.tensors if t.name == "d2t"), 0),
        **(_dflash_fields(meta, {t.name for t in header.tensors}) if arch == "dflash" else {}),
        embedding_length_out=meta.get(f"{arch}.embedding_length_out"),
        **_attention_fields(meta, arch),
    )


_FIRST_READ = 8 << 20  # a 262k-token vocabulary header is about 6 MB


def _parse_file_header(path: Path, size: int) -> GGUFHeader:
    """Parse the header from a prefix of the file, reading more only if the header is longer."""
    want = min(size, _FIRST_READ)
    with path.open("rb") as f:
        while True:
            f.seek(0)
            data = f.read(want)
            try:
                return parse_header(data)
            except NeedMoreData:
                if want >= size:
                    raise
                want = min(size, want * 4)


def _read(path: Path) -> GGUFInfo:
    if not path.is_file():
        raise ModelError(f"{path}: not a file")
    size = path.stat().st_size
    if size == 0:
        raise ModelError(f"{path}: empty file, not a GGUF")
    try:
        header = _parse_file_header(path, size)
    except NeedMoreData:
        raise ModelError(f"{path}: truncated GGUF (the file ends inside its header)") from None
    except HeaderError as e:
        raise ModelError(f"{path}: {e}") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror})") from None
    return info_from_header(path, header, size)


@lru_cache(maxsize=16)
def _read_cached(path: Path, size: int, mtime_ns: int) -> GGUFInfo:
    return _read(path)


def validate_gguf(path: str | Path) -> GGUFInfo:
    """Read and validate a GGUF file; raises ModelError with one clear line when it is unusable."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ModelError(f"{p}: no such file") from None
    except OSError as e:
        raise ModelError(f"{p}: cannot read ({e.strerror})") from None
    return _read_cached(p.resolve(), st.st_size, st.st_mtime_ns)
