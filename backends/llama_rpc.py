"""llama.cpp for the whole process: its backend's start, its log, fatal aborts, and the RPC client and server.

The other half of the llama.cpp binding (backends/llama.py holds models,
contexts and batches); these two modules are the only ones that import
`llama_cpp`. About 500 lines: the RPC client, its server and the checks
that turn ggml's aborts into one line share the same ctypes surface.

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
import os
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import llama_cpp

from models.errors import ModelError

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
    global _initialised
    with _init_lock:
        if not _initialised:
            llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _initialised = True



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


def ggml() -> _Ggml:
    global _ggml_api
    ensure_backend()
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
        ggml().rpc()
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
    while a model loads (`rpc_timeouts_meanwhile`), then after it and after
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
def rpc_timeouts_meanwhile(endpoints: Sequence[str], every: float = 0.2) -> Iterator[None]:
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


def rpc_model_devices(endpoints: Sequence[str]) -> list[int]:
    """The devices of the RPC servers at `endpoints` (checked first), then this machine's GPUs."""
    api = ggml()
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


def check_rpc_memory(info: object, n_gpu_layers: int, devices: Sequence[int], endpoints: Sequence[str]) -> None:
    """ModelError when the offloaded share of the weights cannot fit in the devices' free memory.

    The weights alone are counted (the file's size times the share of the
    n_layer + 1 offloadable layers, the output layer being the +1), so this
    catches a model that is too big before gigabytes cross the network; what
    is left tight (KV cache, compute buffers) fails at load with one line too.
    """
    api = ggml()
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
    return [ggml().dev_info(d) for d in _server_devices(names)]


def _server_devices(names: Sequence[str]) -> list[int]:
    api = ggml()
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
    ensure_backend()
    _add, start_server = ggml().rpc()
    devs = _server_devices(devices)
    array = (ctypes.c_void_p * len(devs))(*devs)
    start_server(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, max(1, threads), len(devs),
                 array)
