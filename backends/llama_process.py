"""llama.cpp for the whole process: its backend's start, its log, ggml's device registry, a fatal abort's exit.

The binding's process-wide part. backends/llama.py holds models, contexts and
batches; backends/llama_rpc.py the RPC client and server, built on the device
registry here. This module and llama.py are the only ones that import
`llama_cpp`.

ggml's device registry (ggml-backend.h) and its RPC entry points (ggml-rpc.h)
have no Python binding in llama-cpp-python, so they are called through ctypes
with their exact C signatures, looked up through libllama's own handle: the
same loaded ggml libraries as llama.cpp's, hence one registry and one set of
RPC connections. ggml aborts the process on some failures (a lost RPC
server); `fatal_exit` is what such an abort becomes: the hooks registered with
`on_fatal_exit` (e.g. putting the terminal back), one line, exit code 2.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, NoReturn

import llama_cpp

from models.errors import ModelError

LLAMA_CPP_VERSION: str = llama_cpp.__version__
# The one command that gives a build with ggml's RPC backend (pip's wheel cache is keyed by version, not by
# CMAKE_ARGS: without --no-cache-dir it reinstalls the cached build without RPC).
RPC_REBUILD_COMMAND = ('CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-deps --no-cache-dir '
                       f'llama-cpp-python=={LLAMA_CPP_VERSION}')
# Exit code when ggml aborts during a run (app.errors.EXIT_RUNTIME: a failure at run time).
FATAL_EXIT_CODE = 2

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


def ensure_backend() -> None:
    """Start llama.cpp's backend once per process, with its log going through `_log_callback`."""
    global _initialised
    with _init_lock:
        if not _initialised:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True


# -- ggml's device registry and RPC entry points ----------------------------------------------------------------

# enum ggml_backend_dev_type (ggml-backend.h)
DEV_CPU, DEV_GPU, DEV_IGPU, DEV_ACCEL = 0, 1, 2, 3
_DEV_TYPE_NAMES = {DEV_CPU: "CPU", DEV_GPU: "GPU", DEV_IGPU: "iGPU", DEV_ACCEL: "accelerator"}

# typedef void (*ggml_abort_callback_t)(const char * error_message);  (ggml.h)
ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
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


class Ggml:
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
        self.set_abort_callback = fn("ggml_set_abort_callback", vp, ABORT_CALLBACK)
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


_ggml_api: Ggml | None = None


def ggml() -> Ggml:
    """The process's one `Ggml` (the backend started first), or ModelError when this ggml lacks a function."""
    global _ggml_api
    ensure_backend()
    with _init_lock:
        if _ggml_api is None:
            try:
                _ggml_api = Ggml()
            except AttributeError as e:  # a ggml too old or too new for these signatures
                raise ModelError(f"this llama-cpp-python's ggml lacks {e.name or e}; reinstall it with: "
                                 f"{RPC_REBUILD_COMMAND}") from None
        return _ggml_api


# -- a fatal abort ---------------------------------------------------------------------------------------------

_abort_lock = threading.Lock()
_before_fatal_exit: list[Callable[[], None]] = []


def on_fatal_exit(hook: Callable[[], None]) -> None:
    """Run `hook` when ggml aborts and the process is about to leave at once (e.g. to put a terminal back).

    A lost RPC server aborts inside ggml, on whatever thread was decoding; no
    Python cleanup (finally blocks, atexit) runs after that, only these hooks.
    """
    _before_fatal_exit.append(hook)


def fatal_exit(line: str) -> NoReturn:
    """Leave the process now: the `on_fatal_exit` hooks, then `line` on stderr, then FATAL_EXIT_CODE.

    Called from ggml's abort callback, on the aborting thread; a second thread
    aborting meanwhile waits here for the first one's exit.
    """
    if not _abort_lock.acquire(blocking=False):  # another thread is already reporting
        threading.Event().wait()
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
    os._exit(FATAL_EXIT_CODE)


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_int8" in f.read()
    except OSError:
        return False


def _build_has_amx() -> bool:
    return b"AMX_INT8 = 1" in (llama_cpp.llama_print_system_info() or b"")


def use_extra_buffer_types() -> bool:
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


# libgomp's omp_pause_resource_all(omp_pause_soft): the calling thread's OpenMP workers end (OpenMP 5.0, GCC 9+).
_OMP_PAUSE_SOFT = 1


def _openmp() -> ctypes.CDLL | None:
    """libgomp, when llama.cpp's CPU backend was built with it (GCC's OpenMP, llama.cpp's default on Linux)
    and so is loaded already; None on other builds (Apple's clang, a build without OpenMP)."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD) if hasattr(os, "RTLD_NOLOAD") else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "omp_pause_resource_all") else None


def release_compute_threads() -> None:
    """The calling thread is done decoding (another thread decodes from now on): its OpenMP workers end.

    ggml's CPU backend runs each graph as an OpenMP parallel region of the thread that called llama_decode,
    and libgomp keeps a team of worker threads for every thread that ever ran one. Once libgomp manages more
    threads than the process has CPUs, it throttles: its barriers, about ten per layer and token, then spin
    100 times and sleep instead of spinning about 3 ms (libgomp's env.c, `gomp_throttled_spin_count_var`).
    A server that warms its contexts up on the main thread and decodes on its engine thread has two teams:
    on 2 CPUs at -t 2, the decoding threads then slept and woke about 330 times a token (SmolLM2 135M), and
    `serve -s ar` ran at 0.88-0.96x llama-server's speed; with the main thread's team released, at
    0.99-1.08x (docs/results.md). A later decode on this thread starts a new team."""
    lib = _openmp()
    if lib is not None:
        lib.omp_pause_resource_all(_OMP_PAUSE_SOFT)
