"""The only module that imports `llama_cpp`: a small typed surface over llama.cpp.

It uses llama-cpp-python's low-level C bindings (`llama_batch_init`,
`llama_decode`, `llama_get_logits_ith`, `llama_memory_seq_*`, ...) rather than
the `Llama` class, because speculation needs what `Llama` hides: several
sequence ids per token, logits on chosen rows, a unified KV cache
(`kv_unified`) and a full-size sliding-window cache (`swa_full`) so that a
rejected draft can be removed from the cache (see llama.cpp's
`examples/speculative` and `examples/lookahead`).

Every file is validated with `gguf` (models.gguf_info) before llama.cpp sees
it, because llama.cpp aborts the whole process on some malformed files.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import llama_cpp
import numpy as np

from backends.errors import DecodeError
from models.errors import ModelError
from models.gguf_info import validate_gguf


_init_lock = threading.Lock()
_initialised = False
_log_enabled = bool(os.environ.get("SPECCHAT_LLAMA_LOG"))


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp is chatty on stderr; specchat reports what matters itself.
    if _log_enabled:
        os.write(2, text)


def set_native_logging(enabled: bool) -> None:
    """Let llama.cpp's own log through to stderr (`--debug`)."""
    global _log_enabled
    _log_enabled = enabled


def _ensure_backend() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True


def supports_gpu_offload() -> bool:
    _ensure_backend()
    return bool(llama_cpp.llama_supports_gpu_offload())


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_int8" in f.read()
    except OSError:
        return False


def _build_has_amx() -> bool:
    return b"AMX_INT8 = 1" in (llama_cpp.llama_print_system_info() or b"")


def _use_extra_buffer_types() -> bool:
    """Whether llama.cpp may place weights in its "extra" CPU buffer types (repacked layouts, AMX).

    llama.cpp 0.3.36's AMX matrix kernels segfault (ggml_backend_amx_mul_mat)
    on K-quant models such as Gemma 3 Q4_K_M. A native build on a CPU with AMX
    compiles them in; there, extra buffer types are turned off and the plain
    AVX-512 kernels run (slower on K-quants than the repacked ones). Building
    without AMX (README: "Building for your hardware") avoids both problems.
    SPECCHAT_EXTRA_BUFTS=1 / =0 forces the choice.
    """
    forced = os.environ.get("SPECCHAT_EXTRA_BUFTS")
    if forced in ("0", "1"):
        return forced == "1"
    return not (_cpu_has_amx() and _build_has_amx())


def build_info() -> str:
    """This llama.cpp build: version and compiled-in features (a rebuild changes the device's costs)."""
    _ensure_backend()
    return f"llama-cpp-python {llama_cpp.__version__}: " + (llama_cpp.llama_print_system_info() or b"").decode(
        "utf-8", errors="replace").strip()


def max_sequences() -> int:
    """The most sequence ids a llama.cpp context may have (LLAMA_MAX_SEQ)."""
    return int(llama_cpp.llama_max_parallel_sequences())


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


class LlamaModel:
    """Weights and vocabulary of one GGUF file."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, rpc: Sequence[str] = ()) -> None:
        if rpc:
            raise ModelError("--rpc is not supported yet")
        self.path = Path(path)
        self.info = validate_gguf(self.path)
        _ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = _use_extra_buffer_types()
        ptr = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            raise ModelError(f"{self.path}: llama.cpp could not load this model (run with --debug for its log)")
        self._ptr = ptr
        self._vocab = llama_cpp.llama_model_get_vocab(ptr)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.bos: int = llama_cpp.llama_vocab_bos(self._vocab)
        self.eos: int = llama_cpp.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(ptr)
        self._piece_cache: dict[int, bytes] = {}

    @property
    def ptr(self) -> ctypes.c_void_p:
        if not self._ptr:
            raise RuntimeError("model is closed")
        return self._ptr

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes this token adds to the text (special tokens render as nothing)."""
        cached = self._piece_cache.get(token)
        if cached is not None:
            return cached
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        out = buf.raw[:n]
        self._piece_cache[token] = out
        return out

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of a token sequence, as llama.cpp's own detokenizer renders it."""
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        size = 64 + 16 * len(tokens)
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self._vocab, arr, len(tokens), buf, size, True, False)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n
        raise RuntimeError("llama_detokenize failed")

    def token_text(self, token: int) -> str:
        """The vocabulary entry itself (e.g. '▁cat'), not the rendered piece."""
        return llama_cpp.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class ContextConfig:
    """How to build a context. `n_seq_max` > 1 and `kv_unified` are what tree and lookahead need."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = True
    swa_full: bool = True
    n_threads: int | None = None


class Batch:
    """A llama_batch where one token may belong to several sequences and carry a logits flag."""

    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        self.capacity = capacity
        self.n_seq_max = n_seq_max
        self._b = llama_cpp.llama_batch_init(capacity, 0, n_seq_max)

    def __len__(self) -> int:
        return self._b.n_tokens

    def clear(self) -> None:
        self._b.n_tokens = 0

    def add(self, token: int, pos: int, seq_ids: Iterable[int] = (0,), logits: bool = False) -> int:
        """Append one token; returns its row (the index to read its logits with)."""
        b = self._b
        i = b.n_tokens
        if i >= self.capacity:
            raise ValueError(f"batch is full ({self.capacity} tokens)")
        b.token[i] = token
        b.pos[i] = pos
        n = 0
        for n, seq in enumerate(seq_ids, start=1):
            b.seq_id[i][n - 1] = seq
        b.n_seq_id[i] = n
        b.logits[i] = logits
        b.n_tokens = i + 1
        return i

    @property
    def raw(self) -> llama_cpp.llama_batch:
        return self._b

    def close(self) -> None:
        if getattr(self, "_b", None) is not None:
            llama_cpp.llama_batch_free(self._b)
            self._b = None

    def __del__(self) -> None:
        self.close()


class LlamaContext:
    """One inference context (KV cache + compute buffers) over a loaded model."""

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig()) -> None:
        self.model = model
        self.config = config
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = config.n_batch
        params.n_ubatch = min(config.n_ubatch, config.n_batch)
        params.n_seq_max = config.n_seq_max
        params.kv_unified = config.kv_unified
        params.swa_full = config.swa_full
        threads = config.n_threads or default_threads()
        params.n_threads = threads
        params.n_threads_batch = threads
        ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise ModelError(f"{model.path}: llama.cpp could not create a context of {config.n_ctx} tokens")
        self._ptr = ptr
        self._mem = llama_cpp.llama_get_memory(ptr)
        self.n_ctx: int = llama_cpp.llama_n_ctx(ptr)
        # llama.cpp lowers n_batch to n_ctx when the context is smaller; a bigger batch would abort.
        self.n_batch: int = llama_cpp.llama_n_batch(ptr)
        self.n_vocab = model.n_vocab

    def decode(self, batch: Batch) -> None:
        rc = llama_cpp.llama_decode(self._ptr, batch.raw)
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc} (batch of {len(batch)} tokens)")

    def logits(self, row: int) -> np.ndarray:
        """Logits of batch row `row` of the last decode: a view, valid until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self._ptr, row)
        if not ptr:
            raise DecodeError(f"no logits for batch row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove cells of `seq` (-1: all) in [p0, p1); False if the cache cannot do a partial removal."""
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_keep(self._mem, seq)

    def pos_max(self, seq: int) -> int:
        """Largest position held by `seq`, -1 when empty."""
        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq))

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self._mem, True)

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            llama_cpp.llama_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        self.close()


# Quantization types by llama.cpp's names (tools/quantize); used to derive drafts.
QUANT_TYPES: dict[str, int] = {
    "F32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q3_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
}


def quantize(src: str | Path, dst: str | Path, quant: str, threads: int | None = None) -> None:
    """Write `dst` as `src` re-quantized to `quant` (llama_model_quantize, requantize allowed).

    Written under a temporary name and renamed into place when whole, so an
    interrupted run never leaves a truncated model behind.
    """
    key = quant.upper()
    if key not in QUANT_TYPES:
        raise ModelError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANT_TYPES)}")
    validate_gguf(Path(src))
    _ensure_backend()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[key]
    params.allow_requantize = True
    params.nthread = threads or default_threads()
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise ModelError(f"quantizing {src} to {key} failed (code {rc})")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
