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

The process-wide side of llama.cpp (its backend's start, its log, ggml's
device registry, a ggml abort turned into one line) lives in
backends/llama_process.py, the only other module that imports `llama_cpp`;
the RPC client and server, built on it, in backends/llama_rpc.py.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import llama_cpp
import numpy as np

from backends.errors import DecodeError
from backends.guidance_vocab import llguidance_tokenizer
from backends.llama_process import ensure_backend, ggml, use_extra_buffer_types
from backends.llama_rpc import check_rpc_memory, rpc_model_devices, rpc_timeouts_meanwhile, set_rpc_timeouts
from models.errors import ModelError
from models.gguf_info import validate_gguf


def build_info() -> str:
    """This llama.cpp build: version and compiled-in features (a rebuild changes the device's costs)."""
    ensure_backend()
    return f"llama-cpp-python {llama_cpp.__version__}: " + (llama_cpp.llama_print_system_info() or b"").decode(
        "utf-8", errors="replace").strip()


def max_sequences() -> int:
    """The most sequence ids a llama.cpp context may have (LLAMA_MAX_SEQ)."""
    return int(llama_cpp.llama_max_parallel_sequences())


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


class LlamaModel:
    """Weights and vocabulary of one GGUF file."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, rpc: Sequence[str] = (), info: object = None,
                 load_mtp: bool = False) -> None:
        """Load `path` with `n_gpu_layers` layers offloaded (llama.cpp's -ngl; negative: all).

        With `load_mtp`, the file's MTP (NextN) layers are loaded too, for an
        MTP context beside the target's (backends.mtp); without it llama.cpp
        skips them, as llama-server does unless asked for `--spec-type draft-mtp`.

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
        self.info = info if info is not None else validate_gguf(self.path)  # the caller may have checked it
        self.rpc: tuple[str, ...] = tuple(rpc)
        ensure_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_extra_bufts = use_extra_buffer_types()
        params.load_mtp = load_mtp
        self._devices: ctypes.Array | None = None  # the NULL-terminated list llama.cpp reads at load
        self.devices: tuple[str, ...] = ()  # names of the devices offered for the offloaded layers (RPC)
        if self.rpc:
            if n_gpu_layers == 0:
                params.n_gpu_layers = -1
            devices = rpc_model_devices(self.rpc)
            check_rpc_memory(self.info, params.n_gpu_layers, devices, self.rpc)
            self._devices = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
            self.devices = tuple(ggml().dev_name(d) for d in devices)
        with rpc_timeouts_meanwhile(self.rpc):  # the weights go to the servers during the load
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
        self.n_embd: int = llama_cpp.llama_model_n_embd(ptr)
        # MTP layers loaded with the model (0 when the file has none or they were not asked for).
        self.n_layer_nextn: int = int(llama_cpp.llama_model_n_layer_nextn(ptr)) if load_mtp else 0
        self._piece_cache: dict[tuple[int, bool], bytes] = {}

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

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes this token adds to the text; a control token renders as nothing unless `special`."""
        cached = self._piece_cache.get((token, special))
        if cached is not None:
            return cached
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        out = buf.raw[:n]
        self._piece_cache[(token, special)] = out
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
        character it has no token for): grammars are refused on it with one line. The rest, the spelling and
        its checks, is backends.guidance_vocab's."""
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
        return llguidance_tokenizer(self.path.name, tokens, lambda text: self.tokenize(text, False, False),
                                    self.bos, self.eos, self.eog_ids)

    def _spm_has_bytes(self) -> bool:
        """Whether a SentencePiece vocabulary holds the 256 byte tokens <0x00>..<0xFF> (its fallback)."""
        texts = {llama_cpp.llama_vocab_get_text(self._vocab, t) for t in range(self.n_vocab)}
        return all(b"<0x%02X>" % b in texts for b in range(256))

    @functools.cached_property
    def vocab_hash(self) -> bytes:
        """SHA-256 of the vocabulary (every token's text and attributes): models that share it share a
        speculation memory (backends.memory)."""
        import hashlib

        h = hashlib.sha256(str(self.n_vocab).encode())
        for t in range(self.n_vocab):
            h.update(llama_cpp.llama_vocab_get_text(self._vocab, t) or b"")
            h.update(b"\0%d\0" % llama_cpp.llama_vocab_get_attr(self._vocab, t))
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
    n_rs_seq: int = 0  # recurrent-state snapshots per sequence: how far back a recurrent cache can be cut


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
    """One inference context (KV cache + compute buffers) over a loaded model.

    With `other` (the target's context, llama.cpp's ctx_other) it is a drafter
    that reads the target: with `mtp`, the target model's MTP context
    (LLAMA_CONTEXT_TYPE_MTP), which runs only the NextN layers on rows that
    carry a hidden state beside their token (backends.mtp); without, an EAGLE-3
    draft's (default type), which may borrow the target's token embeddings and
    output head (backends.eagle3; src/models/eagle3.cpp:165-171, 298-304).
    """

    def __init__(self, model: LlamaModel, config: ContextConfig = ContextConfig(),
                 other: "LlamaContext | None" = None, mtp: bool = False) -> None:
        self.model = model
        self.config = config
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = config.n_batch
        params.n_ubatch = min(config.n_ubatch, config.n_batch)
        params.n_seq_max = config.n_seq_max
        params.kv_unified = config.kv_unified
        params.swa_full = config.swa_full
        params.n_rs_seq = config.n_rs_seq
        threads = config.n_threads or default_threads()
        params.n_threads = threads
        params.n_threads_batch = threads
        if other is not None:
            params.ctx_other = other.ptr
        if mtp:
            params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not ptr:
            what = "an MTP context" if mtp else "a context"
            raise ModelError(f"{model.path}: llama.cpp could not create {what} of {config.n_ctx} tokens")
        self._ptr = ptr
        if model.rpc:
            set_rpc_timeouts(model.rpc)
        self._mem = llama_cpp.llama_get_memory(ptr)
        self.n_ctx: int = llama_cpp.llama_n_ctx(ptr)
        # llama.cpp lowers n_batch to n_ctx when the context is smaller; a bigger batch would abort.
        self.n_batch: int = llama_cpp.llama_n_batch(ptr)
        self.n_vocab = model.n_vocab
        self._row = ctypes.c_float * self.n_vocab  # one row of logits, to view in place (`logits`)
        self.threads = threads  # what decodes run with now (`set_threads`)

    def set_threads(self, n: int) -> int:
        """Decode with `n` threads from now on (llama_set_n_threads, between decodes: backends.thread_count)."""
        if n != self.threads:
            llama_cpp.llama_set_n_threads(self.ptr, n, n)
            self.threads = n
        return n

    @property
    def ptr(self) -> ctypes.c_void_p:
        if not self._ptr:
            raise RuntimeError("context is closed")
        return self._ptr

    def decode(self, batch: Batch) -> None:
        """Decode `batch`, returning once its results are ready: on a GPU llama_decode only queues the work, and
        every decode the engine times (its cost curves, the draft's cost) timed the launch alone (an identical
        draft read 8.6x the target on an H200: docs/results.md, "A GPU"). The logits are read next anyway."""
        rc = llama_cpp.llama_decode(self._ptr, batch.raw)
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc} (batch of {len(batch)} tokens)")
        llama_cpp.llama_synchronize(self._ptr)

    def logits(self, row: int) -> np.ndarray:
        """Logits of batch row `row` of the last decode: a view, valid until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self._ptr, row)
        if not ptr:
            raise DecodeError(f"no logits for batch row {row}")
        # Not np.ctypeslib.as_array, which makes a new array type each call (every step reads a row: docs/results.md).
        return np.frombuffer(self._row.from_address(ctypes.addressof(ptr.contents)), dtype=np.float32)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove cells of `seq` (-1: all) in [p0, p1); False if the cache cannot do a partial removal."""
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_state(self, seq: int) -> bytearray:
        """Every cell of `seq` (positions and K/V), as llama.cpp serialises one sequence's state: what
        `seq_restore` puts back into any sequence id of this context. llama.cpp writes it straight into the
        returned buffer (a few MB for a conversation: no second copy)."""
        size = llama_cpp.llama_state_seq_get_size(self._ptr, seq)
        state = bytearray(size)
        got = llama_cpp.llama_state_seq_get_data(self._ptr, (ctypes.c_uint8 * size).from_buffer(state), size, seq)
        del state[got:]
        return state

    def seq_restore(self, seq: int, state: bytearray) -> bool:
        """Put a `seq_state` back as sequence `seq` (which must be empty); False when llama.cpp could not
        (no room for the cells, a state of another context): the sequence is then left empty."""
        src = (ctypes.c_uint8 * len(state)).from_buffer(state)
        return llama_cpp.llama_state_seq_set_data(self._ptr, src, len(state), seq) > 0

    def seq_keep(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_keep(self._mem, seq)

    def pos_max(self, seq: int) -> int:
        """Largest position held by `seq`, -1 when empty."""
        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq))

    def clear(self) -> None:
        """Empty the cache: every cell of every sequence. Its metadata only, as llama-server's slots empty theirs
        (llama_memory_seq_rm): llama.cpp zeroes the buffers once, at allocation, and never reads a cell that holds
        no token (a recurrent state taken anew is zeroed in its graph, rs_z). Clearing the data as well wrote the
        whole cache, 10-12 ms at 4,096 cells of SmolLM2 and 45-58 ms at 16,384, before the first token of every
        request and chat turn that restored a prompt into an emptied context (docs/results.md)."""
        llama_cpp.llama_memory_clear(self._mem, False)

    def warm_up(self, tokens: Sequence[int]) -> None:
        """llama.cpp's warm-up (common/common.cpp, `common_init_from_params`, which llama-server and llama-cli
        run at load): one decode of `tokens` (BOS and EOS) with every weight in use (`llama_set_warmup`: all of
        an MoE's experts), then the cache emptied. The first request then does not pay for paging the weights
        in and for the first graphs: a restarted server's first token on a restored conversation took 0.9-1.1 s
        cold and 0.23-0.29 s after one small request (Gemma 3 270M, docs/results.md)."""
        batch = Batch(max(1, len(tokens)))
        llama_cpp.llama_set_warmup(self.ptr, True)
        try:
            for pos, token in enumerate(tokens):
                batch.add(token, pos, (0,), logits=pos == len(tokens) - 1)
            self.decode(batch)
        finally:
            llama_cpp.llama_set_warmup(self.ptr, False)
            batch.close()
            self.clear()

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
    ensure_backend()
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
