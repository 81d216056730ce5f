"""llama.cpp's RPC client and server: the target's layers on other machines.

Part of the llama.cpp binding: backends/llama.py holds models, contexts and
batches, backends/llama_process.py the process-wide part (the backend, its
log, ggml's device registry and RPC entry points through ctypes, a fatal
abort's exit); this module drives those entry points and the sockets around
them, and imports no `llama_cpp` of its own.

RPC (`--rpc HOST:PORT`, `specchat rpc-server`): the target's layers can run on
llama.cpp RPC servers while the draft stays on this machine. llama-cpp-python
has no Python binding for ggml's RPC backend, so the functions of this build's
`ggml-rpc.h` and `ggml-backend.h` are called through ctypes
(backends.llama_process.Ggml). The client follows
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
import threading
from typing import Iterator, Sequence

from backends.llama_process import ABORT_CALLBACK, DEV_ACCEL, DEV_CPU, DEV_GPU, DEV_IGPU, LLAMA_CPP_VERSION, \
    DeviceInfo, Ggml, fatal_exit, ggml
from models.errors import ModelError

# ggml-rpc.h of the vendored llama.cpp: a server must speak the same major version and no newer minor one.
RPC_PROTO_MAJOR_VERSION = 7
RPC_PROTO_MINOR_VERSION = 0
# ggml/src/ggml-rpc/ggml-rpc.cpp and transport.h: RPC_CMD_HELLO, rpc_msg_hello_req/_rsp, RPC_CONN_CAPS_SIZE.
_RPC_CMD_HELLO = 14
_RPC_CONN_CAPS_SIZE = 24
_RPC_HELLO_RSP_SIZE = 4 + _RPC_CONN_CAPS_SIZE
# Seconds to wait for a server's TCP connection and for its HELLO answer before giving up with one line.
RPC_CHECK_TIMEOUT = 5.0
# Seconds one read or write on an RPC connection may wait before the server is given up as lost: a server
# that stops answering without closing the connection (a frozen machine, a suspended process, a cable
# pulled) would otherwise keep ggml's client waiting forever. One wait covers one request, at most one target
# forward pass on the server, so it is far longer than any forward a usable server takes.
# SPECCHAT_RPC_TIMEOUT sets it.
RPC_TIMEOUT = 120.0


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
                f"{RPC_PROTO_MINOR_VERSION}: run the same llama-cpp-python ({LLAMA_CPP_VERSION}) on both machines")
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


def _local_offload_devices(api: Ggml) -> list[int]:
    """This machine's GPUs (integrated ones only when there is no discrete one), as llama.cpp lists them."""
    gpus: list[int] = []
    igpus: list[int] = []
    for i in range(api.dev_count()):
        dev = api.dev_get(i)
        kind = api.dev_type(dev)
        if kind == DEV_GPU and not api.is_rpc_device(dev):
            gpus.append(dev)
        elif kind == DEV_IGPU:
            igpus.append(dev)
    return gpus or igpus


_endpoints_lock = threading.Lock()
_rpc_endpoints_in_use: list[str] = []
_rpc_timeout_in_use = RPC_TIMEOUT


@ABORT_CALLBACK
def _on_ggml_abort(message: bytes | None) -> None:
    """ggml is about to abort(): say it in one line (naming the servers when RPC failed) and leave with the
    run-time failure code instead (backends.llama_process.fatal_exit)."""
    text = (message or b"").decode("utf-8", errors="replace").strip()
    detail = text.split(": ", 1)[1] if ": " in text and ".c" in text.split(": ", 1)[0] else text
    detail = " ".join(detail.split())
    servers = ", ".join(_rpc_endpoints_in_use)
    if "RPC" in detail or "connect" in detail:
        line = (f"lost the RPC server {servers}: it closed the connection or did not answer within "
                f"{_rpc_timeout_in_use:g} s ({detail})")
    else:
        line = f"llama.cpp stopped: {detail}"
    fatal_exit(line)


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
    with _endpoints_lock:
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
    devices = [d for d in all_devices if api.dev_type(d) not in (DEV_CPU, DEV_ACCEL) and not api.is_rpc_device(d)]
    return devices or [d for d in all_devices if api.dev_type(d) == DEV_CPU][:1]


def serve_rpc(host: str, port: int, threads: int, cache_dir: str | None = None, devices: Sequence[str] = ()) -> None:
    """Serve this machine's devices to llama.cpp RPC clients on host:port; blocks (ggml_backend_rpc_start_server).

    It returns only when ggml's server could not start (it printed why: the
    port is taken, a device failed to initialise); it never stops by itself
    otherwise, so callers run it in a thread they can abandon. `cache_dir`
    keeps the weights clients send (by hash), so a client reloading the same
    model sends only hashes (rpc-server's -c).
    """
    _add, start_server = ggml().rpc()
    devs = _server_devices(devices)
    array = (ctypes.c_void_p * len(devs))(*devs)
    start_server(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, max(1, threads), len(devs),
                 array)
