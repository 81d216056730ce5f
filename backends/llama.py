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

RPC (`--rpc HOST:PORT`, `specchat rpc-server`): the target's layers can run on
llama.cpp RPC servers while the draft stays on this machine. llama-cpp-python
has no Python binding for ggml's RPC backend, so the functions of this build's
`ggml-rpc.h` and `ggml-backend.h` are called through ctypes, from the same
loaded libraries as llama.cpp itself (looked up through libllama's handle, so
there is one registry and one set of RPC connections). The client follows
llama.cpp's `common/arg.cpp` (`--rpc`: `ggml_backend_rpc_add_server` per
endpoint, then their devices take the offloaded layers), except that the
devices go to the target alone through `llama_model_params.devices` instead
of the global registry: registered globally they would be every model's
devices, so `-ngld` would send the draft's layers over the network too and
the draft's context would open backends on the servers. The server follows
`tools/rpc/rpc-server.cpp` (its device choice and its warning). ggml's RPC
client aborts the process when a server cannot be reached or dies
(`GGML_ABORT` in `ggml/src/ggml-rpc/ggml-rpc.cpp`), so every endpoint is
checked first with a plain TCP connection and the protocol's HELLO (short
timeouts), and an abort during a run becomes one error line and exit code 2
(`ggml_set_abort_callback`). ggml's client also waits forever on a server
that stops answering without closing the connection; its sockets get a
receive and send timeout (`set_rpc_timeouts`), which turns that into the same
abort.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

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
        """Load `path` with `n_gpu_layers` layers offloaded (llama.cpp's -ngl; negative: all).

        With `rpc` (HOST:PORT endpoints of llama.cpp RPC servers) the offloaded
        layers go to the servers' devices (then to this machine's GPUs, as
        llama.cpp orders them), and the rest stays on this CPU. llama.cpp
        offloads nothing without -ngl; here `n_gpu_layers=0` with `rpc` means
        every layer, because whoever names an RPC server wants the model
        there; pass a positive count to keep the remaining layers local.
        Each server is checked first (reachable, same protocol version, not
        busy with another client, enough memory) so that a problem is one
        ModelError line instead of ggml aborting the process.
        """
        self.path = Path(path)
        self.info = validate_gguf(self.path)
        self.rpc: tuple[str, ...] = tuple(rpc)
        _ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = _use_extra_buffer_types()
        self._devices: ctypes.Array | None = None  # the NULL-terminated list llama.cpp reads at load
        self.devices: tuple[str, ...] = ()  # names of the devices offered for the offloaded layers (RPC)
        if self.rpc:
            if n_gpu_layers == 0:
                params.n_gpu_layers = -1
            devices = _rpc_model_devices(self.rpc)
            _check_rpc_memory(self.info, params.n_gpu_layers, devices, self.rpc)
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
            self.devices = tuple(_ggml().dev_name(d) for d in devices)
        with _rpc_timeouts_meanwhile(self.rpc):  # the weights go to the servers during the load
            ptr = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            where = f" with its layers on the RPC server{'s' if len(self.rpc) > 1 else ''} {', '.join(self.rpc)}" \
                if self.rpc else ""
            hint = " (too big for their memory? lower -ngl; run with --debug for llama.cpp's log)" if self.rpc \
                else " (run with --debug for its log)"
            raise ModelError(f"{self.path}: llama.cpp could not load this model{where}{hint}")
        self._ptr = ptr
        if self.rpc:
            set_rpc_timeouts(self.rpc)
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

    @functools.cached_property
    def guidance_tokenizer(self):  # -> llguidance.LLTokenizer
        """This vocabulary as llguidance sees it, for grammars (backends.grammar): every token's bytes (control
        tokens, and user-defined ones that look like them, marked special with a 0xff byte, as llguidance's
        own llama.cpp adapter marks them), llama.cpp's tokenizer, and the end-of-generation tokens as the ends
        a grammar allows once complete. Built once per model (a fraction of a second for 50k tokens).

        llguidance's adapter (llguidance.llamacpp) hands llama_tokenize to Rust as a raw pointer; on a
        vocabulary without byte tokens it crashed the process here, so the tokenizer goes through Python.
        Such a SentencePiece vocabulary cannot spell every text at all (llama.cpp's tokenizer aborts on a
        character it has no token for): grammars are refused on it with one line."""
        import llguidance

        if llama_cpp.llama_vocab_type(self._vocab) == llama_cpp.LLAMA_VOCAB_TYPE_SPM and not self._spm_has_bytes():
            raise ModelError(f"{self.path.name}: this SentencePiece vocabulary has no byte tokens, so it cannot "
                             "spell every text a grammar may ask for")
        control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
        user = llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        buf = ctypes.create_string_buffer(1024)
        tokens: list[bytes] = []
        for t in range(self.n_vocab):
            n = llama_cpp.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, True)
            piece = buf.raw[:max(n, 0)]
            attr = llama_cpp.llama_vocab_get_attr(self._vocab, t)
            if attr & control or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
            tokens.append(piece)
        model = self
        # A SentencePiece vocabulary that adds a space before every text (llama.cpp's add_space_prefix, Llama 2's
        # default) would make llguidance read that space as part of whatever it asks to tokenize: a text is
        # tokenized without it (the first token's leading space taken off and the rest spelt by the longest
        # pieces), so that the tokens spell exactly the text.
        probe = self.tokenize("a", add_special=False, parse_special=False)
        adds_space = bool(probe) and tokens[probe[0]].startswith(b" ")
        by_piece = {p: t for t, p in enumerate(tokens) if p and not p.startswith(b"\xff")} if adds_space else {}
        longest = max(map(len, by_piece), default=1)

        def spell(data: bytes) -> list[int]:
            out, i = [], 0
            while i < len(data):
                n = next((n for n in range(min(longest, len(data) - i), 0, -1) if data[i:i + n] in by_piece), 0)
                if n == 0:
                    return []  # not spellable piece by piece: leave it to the tokenizer
                out.append(by_piece[data[i:i + n]])
                i += n
            return out

        class _Vocabulary:  # what llguidance.TokenizerWrapper reads
            eos_token_id = self.eos if self.eos >= 0 else (self.eog_ids[0] if self.eog_ids else 0)
            bos_token_id = self.bos if self.bos >= 0 else None
            special_token_ids = [t for t in range(self.n_vocab) if tokens[t].startswith(b"\xff")]

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: str | bytes) -> list[int]:
                s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
                ids = model.tokenize(s, add_special=False, parse_special=False)
                if adds_space and ids and tokens[ids[0]].startswith(b" "):  # llama.cpp adds it to every text
                    rest = tokens[ids[0]][1:]
                    head = spell(rest) if rest else []
                    if rest and not head:
                        return ids
                    ids = head + ids[1:]
                return ids

        vocabulary = _Vocabulary()
        # llguidance allows a forced stretch only in the tokens this tokenizer spells it with: they must spell it
        # back byte for byte, or the grammar would refuse what its own mask allowed, mid-answer.
        for probe in ("{", '{"a": 1}', " x", "a b", "\n"):
            spelt = b"".join(tokens[t] for t in vocabulary(probe))
            if spelt != probe.encode():
                raise ModelError(f"{self.path.name}: this vocabulary's tokenizer spells {probe!r} as {spelt!r}, so "
                                 "grammars cannot run on it")
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), n_vocab=self.n_vocab,
                                      eos_token=list(self.eog_ids) or None)

    def _spm_has_bytes(self) -> bool:
        """Whether a SentencePiece vocabulary holds the 256 byte tokens <0x00>..<0xFF> (its fallback)."""
        texts = {llama_cpp.llama_vocab_get_text(self._vocab, t) for t in range(self.n_vocab)}
        return all(b"<0x%02X>" % b in texts for b in range(256))

    @functools.cached_property
    def vocab_hash(self) -> bytes:
        """SHA-256 of the vocabulary (every token's text and attributes): models that share it share a
        speculation memory (backends.suffix)."""
        import hashlib

        h = hashlib.sha256(str(self.n_vocab).encode())
        for t in range(self.n_vocab):
            h.update(llama_cpp.llama_vocab_get_text(self._vocab, t) or b"")
            h.update(b"\0%d\0" % llama_cpp.llama_token_get_attr(self._vocab, t))
        return h.digest()

    @functools.cached_property
    def eog_ids(self) -> tuple[int, ...]:
        """Every end-of-generation token of the vocabulary (EOS, EOT, <|im_end|>, ...)."""
        return tuple(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t))

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
        if model.rpc:
            set_rpc_timeouts(model.rpc)
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


# -- llama.cpp RPC -----------------------------------------------------------------------------------------------

# The one command that gives a build with ggml's RPC backend (pip's wheel cache is keyed by version, not by
# CMAKE_ARGS: without --no-cache-dir it reinstalls the cached build without RPC).
RPC_REBUILD_COMMAND = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-deps --no-cache-dir '
                       f'llama-cpp-python=={llama_cpp.__version__}')
# ggml-rpc.h of the vendored llama.cpp: a server must speak the same major version and no newer minor one.
RPC_PROTO_MAJOR_VERSION = 7
RPC_PROTO_MINOR_VERSION = 0
# ggml/src/ggml-rpc/ggml-rpc.cpp and transport.h: RPC_CMD_HELLO, rpc_msg_hello_req/_rsp, RPC_CONN_CAPS_SIZE.
_RPC_CMD_HELLO = 14
_RPC_CONN_CAPS_SIZE = 24
_RPC_HELLO_RSP_SIZE = 4 + _RPC_CONN_CAPS_SIZE
# Seconds to wait for a server's TCP connection and for its HELLO answer before giving up with one line.
RPC_CHECK_TIMEOUT = 5.0
# Exit code when ggml aborts during a run (app.errors.EXIT_RUNTIME: a failure at run time).
RPC_LOST_EXIT_CODE = 2
# Seconds one read or write on an RPC connection may wait before the server is given up as lost: a server
# that stops answering without closing the connection (a frozen machine, a suspended process, a cable
# pulled) would otherwise keep ggml's client waiting forever. One wait covers one request, at most one target
# forward pass on the server, so it is far longer than any forward a usable server takes.
# SPECCHAT_RPC_TIMEOUT sets it.
RPC_TIMEOUT = 120.0

# enum ggml_backend_dev_type (ggml-backend.h)
_DEV_CPU, _DEV_GPU, _DEV_IGPU, _DEV_ACCEL = 0, 1, 2, 3
_DEV_TYPE_NAMES = {_DEV_CPU: "CPU", _DEV_GPU: "GPU", _DEV_IGPU: "iGPU", _DEV_ACCEL: "accelerator"}

# typedef void (*ggml_abort_callback_t)(const char * error_message);  (ggml.h)
_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
# ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);  (ggml-rpc.h)
_RPC_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
# void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
#                                    size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices);  (ggml-rpc.h)
_RPC_START_SERVER = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                     ctypes.POINTER(ctypes.c_void_p))


@dataclass(frozen=True)
class DeviceInfo:
    """One ggml device: `name` as llama.cpp spells it (CPU, CUDA0, RPC0, ...), its memory in bytes."""

    name: str
    description: str
    kind: str
    free: int
    total: int

    def __str__(self) -> str:
        return f"{self.name} ({self.description}, {self.free >> 20} MiB free of {self.total >> 20} MiB)"


class _Ggml:
    """ggml's device registry (ggml-backend.h) and RPC entry points (ggml-rpc.h), with their exact C signatures.

    Looked up through libllama's own handle, which searches the ggml libraries
    it was linked with: the same copies, hence the same registry and the same
    RPC connections as llama.cpp's. The RPC functions come from the "RPC"
    registry entry's proc addresses, as common/arg.cpp and rpc-server.cpp get
    them, so a build without RPC is simply one where that entry is missing.
    """

    def __init__(self) -> None:
        lib = llama_cpp.llama_cpp._lib
        vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p

        def fn(name: str, restype: object, *argtypes: object):
            f = getattr(lib, name)
            f.restype = restype
            f.argtypes = list(argtypes)
            return f

        self.reg_by_name = fn("ggml_backend_reg_by_name", vp, cp)
        self.reg_name = fn("ggml_backend_reg_name", cp, vp)
        self.reg_dev_count = fn("ggml_backend_reg_dev_count", sz, vp)
        self.reg_dev_get = fn("ggml_backend_reg_dev_get", vp, vp, sz)
        self.reg_get_proc_address = fn("ggml_backend_reg_get_proc_address", vp, vp, cp)
        self.dev_count = fn("ggml_backend_dev_count", sz)
        self.dev_get = fn("ggml_backend_dev_get", vp, sz)
        self.dev_by_name = fn("ggml_backend_dev_by_name", vp, cp)
        self.dev_type = fn("ggml_backend_dev_type", ctypes.c_int, vp)
        self.dev_backend_reg = fn("ggml_backend_dev_backend_reg", vp, vp)
        self._dev_name = fn("ggml_backend_dev_name", cp, vp)
        self._dev_description = fn("ggml_backend_dev_description", cp, vp)
        self._dev_memory = fn("ggml_backend_dev_memory", None, vp, ctypes.POINTER(sz), ctypes.POINTER(sz))
        self.set_abort_callback = fn("ggml_set_abort_callback", vp, _ABORT_CALLBACK)
        self._rpc: tuple[object, object] | None = None

    def dev_name(self, dev: int) -> str:
        return (self._dev_name(dev) or b"").decode("utf-8", errors="replace")

    def dev_info(self, dev: int) -> DeviceInfo:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return DeviceInfo(self.dev_name(dev), (self._dev_description(dev) or b"").decode("utf-8", errors="replace"),
                          _DEV_TYPE_NAMES.get(self.dev_type(dev), "other"), free.value, total.value)

    def is_rpc_device(self, dev: int) -> bool:
        reg = self.dev_backend_reg(dev)
        return bool(reg) and self.reg_name(reg) == b"RPC"

    def rpc(self) -> tuple[object, object]:
        """(ggml_backend_rpc_add_server, ggml_backend_rpc_start_server), or ModelError when this build has no RPC."""
        if self._rpc is None:
            reg = self.reg_by_name(b"RPC")
            add = self.reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
            start = self.reg_get_proc_address(reg, b"ggml_backend_rpc_start_server") if reg else None
            if not (add and start):
                raise ModelError(f"this llama-cpp-python was built without RPC; rebuild it with: {RPC_REBUILD_COMMAND}")
            self._rpc = (_RPC_ADD_SERVER(add), _RPC_START_SERVER(start))
        return self._rpc


_ggml_api: _Ggml | None = None


def _ggml() -> _Ggml:
    global _ggml_api
    _ensure_backend()
    with _init_lock:
        if _ggml_api is None:
            try:
                _ggml_api = _Ggml()
            except AttributeError as e:  # a ggml too old or too new for these signatures
                raise ModelError(f"this llama-cpp-python's ggml lacks {e.name or e}; reinstall it with: "
                                 f"{RPC_REBUILD_COMMAND}") from None
        return _ggml_api


def rpc_supported() -> bool:
    """Whether this llama.cpp build has ggml's RPC backend (CMAKE_ARGS="-DGGML_RPC=on")."""
    try:
        _ggml().rpc()
    except ModelError:
        return False
    return True


def parse_rpc_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT as llama.cpp reads it (the first colon splits, so IPv4 addresses and host names only)."""
    host, sep, port = endpoint.partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ModelError(f"RPC server {endpoint!r}: expected HOST:PORT (an IPv4 address or a host name)")
    return host, int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("connection closed")
        data += chunk
    return data


def check_rpc_server(endpoint: str, timeout: float = RPC_CHECK_TIMEOUT) -> tuple[int, int, int]:
    """Connect to `endpoint` and do the RPC protocol's HELLO; its version, or ModelError with one line.

    ggml's own client aborts the process on a refused connection or a failed
    handshake, and can wait for minutes on an address that drops packets; this
    check does the same exchange (ggml-rpc.cpp's negotiate_hello: command 14
    with 24 zero capability bytes, answered with major, minor, patch, padding
    and 24 bytes) with short timeouts before ggml is given the endpoint. The
    server then goes back to accepting: it serves one connection at a time,
    which is also why a server busy with another client does not answer.
    """
    host, port = parse_rpc_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise ModelError(f"RPC server {endpoint} did not answer within {timeout:g} s (wrong address, or a firewall "
                         "in between?)") from None
    except OSError as e:
        raise ModelError(f"cannot reach the RPC server {endpoint}: {e.strerror or e} (is `specchat rpc-server` "
                         "running there?)") from None
    mismatch = (f"RPC server {endpoint} does not speak this build's RPC protocol v{RPC_PROTO_MAJOR_VERSION}."
                f"{RPC_PROTO_MINOR_VERSION}: run the same llama-cpp-python ({llama_cpp.__version__}) on both machines")
    with sock:
        sock.settimeout(timeout)
        try:
            sock.sendall(struct.pack("<BQ", _RPC_CMD_HELLO, _RPC_CONN_CAPS_SIZE) + bytes(_RPC_CONN_CAPS_SIZE))
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            if size != _RPC_HELLO_RSP_SIZE:
                raise ModelError(f"{mismatch} (its handshake answer has {size} bytes, expected "
                                 f"{_RPC_HELLO_RSP_SIZE})")
            major, minor, patch = _recv_exact(sock, _RPC_HELLO_RSP_SIZE)[:3]
        except socket.timeout:
            raise ModelError(f"RPC server {endpoint} accepted the connection but did not answer the handshake within "
                             f"{timeout:g} s: it serves one client at a time, is another one using it?") from None
        except OSError:
            raise ModelError(f"{mismatch} (it closed the connection during the handshake)") from None
    if major != RPC_PROTO_MAJOR_VERSION or minor > RPC_PROTO_MINOR_VERSION:
        raise ModelError(f"{mismatch} (it speaks v{major}.{minor}.{patch})")
    return major, minor, patch


def _local_offload_devices(api: _Ggml) -> list[int]:
    """This machine's GPUs (integrated ones only when there is no discrete one), as llama.cpp lists them."""
    gpus: list[int] = []
    igpus: list[int] = []
    for i in range(api.dev_count()):
        dev = api.dev_get(i)
        kind = api.dev_type(dev)
        if kind == _DEV_GPU and not api.is_rpc_device(dev):
            gpus.append(dev)
        elif kind == _DEV_IGPU:
            igpus.append(dev)
    return gpus or igpus


_rpc_endpoints_in_use: list[str] = []
_rpc_timeout_in_use = RPC_TIMEOUT
_abort_lock = threading.Lock()
_before_fatal_exit: list[Callable[[], None]] = []


def on_fatal_exit(hook: Callable[[], None]) -> None:
    """Run `hook` when ggml aborts and the process is about to leave at once (e.g. to put a terminal back).

    A lost RPC server aborts inside ggml, on whatever thread was decoding; no
    Python cleanup (finally blocks, atexit) runs after that, only these hooks.
    """
    _before_fatal_exit.append(hook)


@_ABORT_CALLBACK
def _on_ggml_abort(message: bytes | None) -> None:
    """ggml is about to abort(): say it in one line and leave with the run-time failure code instead."""
    if not _abort_lock.acquire(blocking=False):  # another thread is already reporting
        threading.Event().wait()
    text = (message or b"").decode("utf-8", errors="replace").strip()
    detail = text.split(": ", 1)[1] if ": " in text and ".c" in text.split(": ", 1)[0] else text
    detail = " ".join(detail.split())
    servers = ", ".join(_rpc_endpoints_in_use)
    if "RPC" in detail or "connect" in detail:
        line = (f"lost the RPC server {servers}: it closed the connection or did not answer within "
                f"{_rpc_timeout_in_use:g} s ({detail})")
    else:
        line = f"llama.cpp stopped: {detail}"
    for hook in _before_fatal_exit:
        try:
            hook()
        except Exception:  # noqa: BLE001 - the process is ending either way
            pass
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the process is ending either way
        pass
    os.write(2, f"specchat: error: {line}\n".encode("utf-8", errors="replace"))
    os._exit(RPC_LOST_EXIT_CODE)


def rpc_timeout() -> float:
    """RPC_TIMEOUT, or SPECCHAT_RPC_TIMEOUT's seconds (ModelError when that is not a positive number)."""
    text = os.environ.get("SPECCHAT_RPC_TIMEOUT", "").strip()
    if not text:
        return RPC_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 1e6:
        raise ModelError(f"SPECCHAT_RPC_TIMEOUT={text!r}: expected a number of seconds above 0")
    return seconds


def _endpoint_addresses(endpoints: Sequence[str]) -> set[tuple[str, int]]:
    addresses = set()
    for endpoint in endpoints:
        host, port = parse_rpc_endpoint(endpoint)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            continue
        addresses.update((info[4][0], port) for info in infos)
    return addresses


def set_rpc_timeouts(endpoints: Sequence[str], seconds: float | None = None) -> int:
    """Give this process's open connections to `endpoints` a receive and send timeout; how many it found.

    ggml's RPC client blocks in recv() with no timeout. With SO_RCVTIMEO a
    server that stops answering makes that recv() fail after `seconds`, which
    ggml treats as a lost server: it aborts, and the abort callback turns that
    into one line and exit code 2, as for a server that closed the connection.
    ggml keeps no socket handle anyone else can reach, so the sockets are found
    among the process's file descriptors by their peer address; they are set
    on a duplicate descriptor, which shares the socket. Called every 0.2 s
    while a model loads (`_rpc_timeouts_meanwhile`), then after it and after
    each context is made: where ggml opens the connections it keeps.
    """
    return _set_socket_timeouts(_endpoint_addresses(endpoints), rpc_timeout() if seconds is None else seconds)


def _set_socket_timeouts(peers: set[tuple[str, int]], seconds: float) -> int:
    """`set_rpc_timeouts` on the connections to the resolved addresses `peers`."""
    global _rpc_timeout_in_use
    _rpc_timeout_in_use = seconds
    timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    found = 0
    for name in os.listdir(fd_dir):
        try:
            dup = os.dup(int(name))
        except (ValueError, OSError):
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # not a socket
            os.close(dup)
            continue
        with sock:
            try:
                peer = sock.getpeername()
            except OSError:  # not connected, or not an internet socket
                continue
            if isinstance(peer, tuple) and (peer[0], peer[1]) in peers:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                found += 1
    return found


@contextlib.contextmanager
def _rpc_timeouts_meanwhile(endpoints: Sequence[str], every: float = 0.2) -> Iterator[None]:
    """While the block runs (a model load, which opens its connections and sends the weights inside
    llama.cpp), put the timeouts on new connections to `endpoints` every `every` seconds."""
    if not endpoints:
        yield
        return
    seconds = rpc_timeout()
    peers = _endpoint_addresses(endpoints)  # resolved once, not at every look
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every):
            _set_socket_timeouts(peers, seconds)

    watcher = threading.Thread(target=watch, name="rpc-timeouts", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _rpc_model_devices(endpoints: Sequence[str]) -> list[int]:
    """The devices of the RPC servers at `endpoints` (checked first), then this machine's GPUs."""
    api = _ggml()
    add_server, _start = api.rpc()
    endpoints = list(dict.fromkeys(endpoints))
    for endpoint in endpoints:
        check_rpc_server(endpoint)
    with _init_lock:
        for endpoint in endpoints:
            if endpoint not in _rpc_endpoints_in_use:
                _rpc_endpoints_in_use.append(endpoint)
        # From here on a server that goes away aborts inside ggml: one line and exit code 2, not a core dump.
        api.set_abort_callback(_on_ggml_abort)
    devices: list[int] = []
    for endpoint in endpoints:
        reg = add_server(endpoint.encode())
        n = api.reg_dev_count(reg) if reg else 0
        if not n:
            raise ModelError(f"RPC server {endpoint} offers no device")
        devices += [api.reg_dev_get(reg, i) for i in range(n)]
    return devices + _local_offload_devices(api)


def _check_rpc_memory(info: object, n_gpu_layers: int, devices: Sequence[int], endpoints: Sequence[str]) -> None:
    """ModelError when the offloaded share of the weights cannot fit in the devices' free memory.

    The weights alone are counted (the file's size times the share of the
    n_layer + 1 offloadable layers, the output layer being the +1), so this
    catches a model that is too big before gigabytes cross the network; what
    is left tight (KV cache, compute buffers) fails at load with one line too.
    """
    api = _ggml()
    n_layers = (getattr(info, "block_count", None) or 0) + 1
    share = 1.0 if n_gpu_layers < 0 or n_gpu_layers >= n_layers else n_gpu_layers / n_layers
    need = int(getattr(info, "size_bytes", 0) * share)
    free = sum(api.dev_info(d).free for d in devices)
    if free and need > free:
        offloaded = "every layer" if share == 1.0 else f"{n_gpu_layers} of {n_layers} layers"
        plural = len(endpoints) > 1 or len(devices) > len(endpoints)
        local = " and this machine's GPUs" if len(devices) > len(endpoints) else ""  # they come after the RPC devices
        raise ModelError(f"{getattr(info, 'path', 'the model')}: {offloaded} need about {need >> 20} MiB on the RPC "
                         f"server{'s' if len(endpoints) > 1 else ''} {', '.join(endpoints)}{local}, which "
                         f"{'have' if plural else 'has'} {free >> 20} MiB free: lower -ngl to keep "
                         "layers here, or add servers")


def rpc_server_devices(names: Sequence[str] = ()) -> list[DeviceInfo]:
    """The devices an RPC server would offer: `names`, else this machine's accelerators, else its CPU.

    tools/rpc/rpc-server.cpp's choice (get_devices). ValueError names an unknown device and lists the known ones.
    """
    return [_ggml().dev_info(d) for d in _server_devices(names)]


def _server_devices(names: Sequence[str]) -> list[int]:
    api = _ggml()
    api.rpc()
    if names:
        devices = []
        for name in names:
            dev = api.dev_by_name(name.encode())
            if not dev:
                known = ", ".join(api.dev_name(api.dev_get(i)) for i in range(api.dev_count()))
                raise ValueError(f"unknown device {name!r}; this machine has {known}")
            devices.append(dev)
        return devices
    all_devices = [api.dev_get(i) for i in range(api.dev_count())]
    devices = [d for d in all_devices if api.dev_type(d) not in (_DEV_CPU, _DEV_ACCEL) and not api.is_rpc_device(d)]
    return devices or [d for d in all_devices if api.dev_type(d) == _DEV_CPU][:1]


def serve_rpc(host: str, port: int, threads: int, cache_dir: str | None = None, devices: Sequence[str] = ()) -> None:
    """Serve this machine's devices to llama.cpp RPC clients on host:port; blocks (ggml_backend_rpc_start_server).

    It returns only when ggml's server could not start (it printed why: the
    port is taken, a device failed to initialise); it never stops by itself
    otherwise, so callers run it in a thread they can abandon. `cache_dir`
    keeps the weights clients send (by hash), so a client reloading the same
    model sends only hashes (rpc-server's -c).
    """
    _ensure_backend()
    _add, start_server = _ggml().rpc()
    devs = _server_devices(devices)
    array = (ctypes.c_void_p * len(devs))(*devs)
    start_server(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, max(1, threads), len(devs),
                 array)
