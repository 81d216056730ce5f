"""`specchat rpc-server`: serve this machine's CPU (or GPUs) to llama.cpp RPC clients.

    specchat rpc-server [--host 127.0.0.1] [--port 50052] [-t N] [--cache [DIR]] [--device NAME[,NAME...]]

The other machine then runs the target's layers here: `specchat run ... --rpc
THIS-HOST:50052`. It is llama.cpp's own RPC server (`tools/rpc/rpc-server.cpp`:
the same device choice, defaults and warning), started through the llama.cpp
library specchat already loads (backends.llama_rpc.serve_rpc), so both machines
run the same llama-cpp-python and hence the same RPC protocol version.

ggml's server call blocks forever in C and has no way to stop it, so it runs in
a daemon thread while the main thread waits for Ctrl-C (which a blocked C call
would not let Python see). Ctrl-C ends the process at once (os._exit): the
thread is still inside accept() or serving a client, and there is nothing of
Python's to save. The server speaks an unauthenticated protocol: upstream's
warning is printed whenever it listens anywhere but loopback.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import threading
import time
from pathlib import Path

from app.errors import EXIT_OK, EXIT_RUNTIME, UserError, print_error

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052  # llama.cpp tools/rpc/rpc-server.cpp's

# tools/rpc/rpc-server.cpp's warning, word for word.
WARNING_LINES = (
    "",
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
    "WARNING: Host ('{host}') is != '127.0.0.1'",
    "         Never expose the RPC server to an open network!",
    "         This is an experimental feature and is not secure!",
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
    "",
)


def add_rpc_parser(sub: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("rpc-server", help="serve this machine's CPU/GPU to another machine's --rpc (llama.cpp RPC)",
                       description="Serve this machine's devices (its GPUs, else its CPU) to llama.cpp RPC clients: "
                                   "`specchat run ... --rpc HOST:PORT` on another machine runs the target's layers "
                                   "here. The protocol has no authentication or encryption: never expose the RPC "
                                   "server to an open network.")
    p.add_argument("-H", "--host", default=DEFAULT_HOST,
                   help=f"IPv4 address to listen on (default: {DEFAULT_HOST}, this machine only)")
    p.add_argument("-p", "--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="threads for the CPU device (default: half the cores, as llama.cpp's rpc-server)")
    p.add_argument("-c", "--cache", nargs="?", const="", default=None, metavar="DIR",
                   help="keep the weights clients send in DIR (default DIR: llama.cpp's cache dir/rpc), so that "
                        "loading the same model again sends only hashes")
    p.add_argument("-d", "--device", default=None, metavar="NAME[,NAME...]",
                   help="devices to serve, by llama.cpp's names (default: every GPU, else the CPU)")


def default_cache_dir() -> Path:
    """Where llama.cpp's rpc-server keeps its cache: $LLAMA_CACHE, else the user cache dir's llama.cpp, then /rpc."""
    env = os.environ.get("LLAMA_CACHE")
    if env:
        return Path(env) / "rpc"
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home())
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llama.cpp" / "rpc"


def _listening(host: str, port: int) -> bool:
    """Whether a socket listens on host:port: Linux's socket table (no connection that the server would log),
    else one TCP connection (the server accepts it and goes back to waiting when it closes)."""
    if sys.platform.startswith("linux"):
        # /proc/net/tcp: local address as little-endian hex IPv4 and hex port; state 0A is LISTEN.
        wanted = {socket.inet_aton(host)[::-1].hex().upper(), "00000000"}
        try:
            with open("/proc/net/tcp") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    addr, _, hex_port = fields[1].partition(":")
                    if fields[3] == "0A" and addr in wanted and int(hex_port, 16) == port:
                        return True
            return False
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    try:
        with socket.create_connection((host if host != "0.0.0.0" else "127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run_rpc_server(args: argparse.Namespace) -> int:
    from backends.llama_rpc import rpc_server_devices, serve_rpc

    host = args.host
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise UserError(f"--host must be an IPv4 address (llama.cpp's RPC server listens on IPv4), got {host!r}") \
            from None
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) // 2)
    if threads <= 0:
        raise UserError(f"--threads must be at least 1, got {threads}")
    names = tuple(n for n in (args.device or "").replace("/", ",").split(",") if n)
    cache_dir: str | None = None
    if args.cache is not None:
        path = Path(args.cache) if args.cache else default_cache_dir()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the cache directory {path}: {e.strerror or e}") from None
        cache_dir = str(path)
    if host != DEFAULT_HOST:
        print("\n".join(WARNING_LINES).format(host=host), file=sys.stderr, flush=True)
    devices = rpc_server_devices(names)  # ModelError (no RPC in this build) / ValueError (unknown device): exit 1
    _check_port_free(host, args.port)

    failed = threading.Event()

    def serve() -> None:
        try:
            serve_rpc(host, args.port, threads, cache_dir, names)
        finally:
            failed.set()  # ggml's server returns only when it could not start

    threading.Thread(target=serve, name="rpc-server", daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while not _listening(host, args.port):
            if failed.wait(0.05):
                sys.stdout.flush()
                print_error(f"the RPC server could not start on {host}:{args.port} (see above)")
                return EXIT_RUNTIME
            if time.monotonic() > deadline:
                print_error(f"the RPC server did not start listening on {host}:{args.port}")
                return EXIT_RUNTIME
        print(f"specchat rpc-server: serving {', '.join(map(str, devices))} on {host}:{args.port} "
              f"({threads} thread{'s' if threads != 1 else ''}{', cache ' + cache_dir if cache_dir else ''}); "
              "Ctrl-C stops it", file=sys.stderr, flush=True)
        while not failed.wait(0.5):
            pass
        print_error(f"the RPC server on {host}:{args.port} stopped (see above)")
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("\nspecchat rpc-server: stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # The server thread is blocked inside ggml for good: leave without waiting for it.
        os._exit(EXIT_OK)
