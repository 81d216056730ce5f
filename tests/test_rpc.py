"""The target over llama.cpp RPC (`--rpc`, `specchat rpc-server`), on loopback only.

Real RPC servers run as subprocesses (`python -m app --debug rpc-server`,
with ggml's GGML_RPC_DEBUG log on), so the tests see what the server
computed: one `graph_compute` / `graph_recompute` line per target forward
pass it ran. That proves the target's layers ran there and the draft's did
not (a remote draft would add one per draft token).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backends.llama_process import RPC_REBUILD_COMMAND
from backends.llama_rpc import rpc_supported, rpc_timeout, set_rpc_timeouts
from models.errors import ModelError

needs_rpc = pytest.mark.skipif(not rpc_supported(), reason=f"this llama-cpp-python has no RPC: {RPC_REBUILD_COMMAND}")
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "the cat sat"
COMPUTE = re.compile(r"\[graph_(re)?compute\]")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RpcServer:
    """`python -m app --debug rpc-server` on 127.0.0.1 (or another loopback address), its log in a file."""

    def __init__(self, log: Path, host: str = "127.0.0.1", *extra: str) -> None:
        self.host, self.port, self.log = host, _free_port(), log
        env = dict(os.environ, GGML_RPC_DEBUG="1")
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app", "--debug", "rpc-server", "--host", host, "--port", str(self.port),
                 "-t", "1", *extra], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + 60
        while "specchat rpc-server: serving" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the RPC server did not start:\n{self.text()}")
            time.sleep(0.05)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def computes(self) -> int:
        """Graphs the server has computed so far (GGML_RPC_DEBUG logs one line per graph)."""
        return len(COMPUTE.findall(self.text()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def rpc_server(tmp_path_factory: pytest.TempPathFactory):
    server = RpcServer(tmp_path_factory.mktemp("rpc") / "server.log")
    yield server
    server.stop()


def _run(tiny, strategy: str, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    draft = ["-md", str(tiny.draft)] if strategy != "ar" else []
    return subprocess.run(
        [sys.executable, "-m", "app", "run", PROMPT, "-m", str(tiny.target), *draft, "-s", strategy, "--temp", "0",
         "--no-color", "-t", "1", "-n", "24", *extra], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@needs_rpc
@pytest.mark.parametrize("strategy", ["ar", "sps", "lookahead"])
def test_greedy_output_with_the_target_over_rpc_equals_the_local_target(tiny, rpc_server, strategy) -> None:
    local = _run(tiny, strategy)
    assert local.returncode == 0, local.stderr
    before = rpc_server.computes()
    remote = _run(tiny, strategy, "--rpc", rpc_server.endpoint)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and remote.stdout.strip()
    # The target really ran on the server: at least one graph per forward pass (24 tokens, at most 24 forwards).
    assert rpc_server.computes() - before >= 8


@needs_rpc
def test_the_draft_runs_locally_while_the_target_is_remote(tiny, rpc_server) -> None:
    before = rpc_server.computes()
    r = _run(tiny, "sps", "--rpc", rpc_server.endpoint, "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout.splitlines()[-1])["stats"]
    computed = rpc_server.computes() - before
    assert stats["drafted"] >= 8, stats  # enough draft work that a remote draft would show
    # One graph per target forward (+ at most the prefill's split): the draft's decodes never reached the server.
    assert stats["target_forwards"] <= computed <= stats["target_forwards"] + 2, (computed, stats)


@needs_rpc
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_server_lost_mid_generation_is_one_line_and_exit_2(tiny, tmp_path, how) -> None:
    """Killed: the connection closes. Frozen (SIGSTOP: a hung machine, a pulled cable): the connection stays
    open and nothing answers; the client gives up after SPECCHAT_RPC_TIMEOUT seconds instead of waiting forever."""
    server = RpcServer(tmp_path / "server.log")
    proc = None
    env = dict(os.environ, SPECCHAT_RPC_TIMEOUT="3")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "run", PROMPT, "-m", str(tiny.target), "-md", str(tiny.draft), "-s", "sps",
             "--temp", "0", "--json", "-t", "1", "-n", "3000", "-c", "4096", "--rpc", server.endpoint],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        tokens = 0
        while tokens < 3:
            line = proc.stdout.readline()
            assert line, f"the run ended before its first tokens: {proc.stderr.read()}"
            tokens += '"type": "token"' in line
        if how == "killed":
            server.stop()
        else:
            server.proc.send_signal(signal.SIGSTOP)
        out, err = proc.communicate(timeout=60)
    finally:
        server.stop()
        if proc is not None and proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specchat: error: lost the RPC server"), err
    assert server.endpoint in lines[0] and "did not answer within 3 s" in lines[0]


def test_rpc_timeouts_go_on_the_connections_to_the_endpoints_only() -> None:
    """Real sockets: the client's connection to the endpoint gets both timeouts; the listening socket, the
    server's side and a connection elsewhere keep none."""
    def timeout_of(sock: socket.socket, option: int) -> float:
        sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("ll")))
        return sec + usec / 1e6

    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_server(("127.0.0.1", 0)) as other:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        elsewhere = socket.create_connection(other.getsockname())
        served, _ = listener.accept()
        with client, elsewhere, served:
            assert set_rpc_timeouts([f"127.0.0.1:{port}"], 2.5) == 1
            assert timeout_of(client, socket.SO_RCVTIMEO) == timeout_of(client, socket.SO_SNDTIMEO) == 2.5
            for sock in (listener, served, elsewhere):
                assert timeout_of(sock, socket.SO_RCVTIMEO) == 0.0


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_rpc_timeout_is_one_clear_error(monkeypatch, value) -> None:
    monkeypatch.setenv("SPECCHAT_RPC_TIMEOUT", value)
    with pytest.raises(ModelError, match="SPECCHAT_RPC_TIMEOUT"):
        rpc_timeout()
    monkeypatch.setenv("SPECCHAT_RPC_TIMEOUT", "7.5")
    assert rpc_timeout() == 7.5


@needs_rpc
def test_a_lost_server_ends_the_chat_app_with_the_terminal_restored(tiny, tmp_path) -> None:
    """The chat app on a real pseudo-terminal: the server dies mid-answer. ggml aborts on the decoding thread,
    so Textual's own shutdown never runs; the app must still leave raw mode and the alternate screen, say why
    in one line, and exit 2."""
    import fcntl
    import pty
    import select
    import termios

    server = RpcServer(tmp_path / "server.log")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    before = termios.tcgetattr(slave)
    env = dict(os.environ, TERM="xterm-256color", SPECCHAT_CONFIG_DIR=str(tmp_path / "config"),
               SPECCHAT_DATA_DIR=str(tmp_path / "data"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "chat", "-m", str(tiny.target), "-s", "ar", "-t", "1", "-c", "4096",
         "-n", "4000", "--temp", "0", "--rpc", server.endpoint],  # greedy: a sampled eos could end it first
        stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env, start_new_session=True)
    out = bytearray()

    def pump(done, seconds: float) -> None:
        """Read what the app draws until done() or the time is up."""
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            if select.select([master], [], [], 0.1)[0]:
                try:
                    out.extend(os.read(master, 65536))
                except OSError:  # the child closed the terminal
                    return

    try:
        pump(lambda: b"loaded" in out, 120)
        assert b"loaded" in out, bytes(out[-2000:])
        computed = server.computes()
        os.write(master, b"tell me a long story\r")
        pump(lambda: server.computes() > computed + 20, 60)
        assert server.computes() > computed + 20, "the answer did not start"
        server.stop()
        pump(lambda: proc.poll() is not None, 60)
        proc.wait(timeout=10)
        pump(lambda: False, 0.5)
        after = termios.tcgetattr(slave)
    finally:
        server.stop()
        if proc.poll() is None:
            proc.kill()
        os.close(slave)
        os.close(master)
    text = bytes(out)
    assert proc.returncode == 2, text[-2000:]
    assert b"specchat: error: lost the RPC server" in text
    assert text.rfind(b"\x1b[?1049l") > text.rfind(b"\x1b[?1049h") >= 0, "left on the alternate screen"
    assert after[3] == before[3], "the terminal's local modes (echo, canonical input) were not put back"


@needs_rpc
def test_an_unreachable_server_at_load_is_one_line_and_exit_1(tiny) -> None:
    started = time.monotonic()
    r = _run(tiny, "sps", "--rpc", f"127.0.0.1:{_free_port()}", timeout=60)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the RPC server 127.0.0.1:" in lines[0], r.stderr
    assert not r.stdout
    assert time.monotonic() - started < 30


@needs_rpc
def test_a_server_of_another_protocol_version_is_one_line_and_exit_1(tiny) -> None:
    """A stand-in server that answers HELLO as protocol v3.0.0 would (llama.cpp's RPC of a year before)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)
            conn.sendall(struct.pack("<Q", 28) + bytes([3, 0, 0, 0]) + bytes(24))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        r = _run(tiny, "ar", "--rpc", f"127.0.0.1:{port}", timeout=60)
    finally:
        listener.close()
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "v7.0" in lines[0] and "v3.0.0" in lines[0], r.stderr


def test_a_build_without_rpc_names_the_rebuild_command(monkeypatch) -> None:
    from backends import llama_process
    from models.errors import ModelError

    api = llama_process.Ggml()
    monkeypatch.setattr(api, "reg_by_name", lambda name: None)
    with pytest.raises(ModelError) as e:
        api.rpc()
    message = str(e.value)
    assert "\n" not in message
    assert 'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==' \
        in message


@needs_rpc
def test_listening_beyond_127_0_0_1_prints_upstreams_warning(tmp_path) -> None:
    server = RpcServer(tmp_path / "server.log", "127.0.0.2")
    try:
        text = server.text()
    finally:
        server.stop()
    assert "WARNING: Host ('127.0.0.2') is != '127.0.0.1'" in text
    assert "Never expose the RPC server to an open network!" in text


@needs_rpc
def test_a_taken_port_is_one_line_and_exit_1(rpc_server) -> None:
    r = subprocess.run([sys.executable, "-m", "app", "rpc-server", "--port", str(rpc_server.port), "-t", "1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{rpc_server.port}" in lines[0], r.stderr


def test_a_model_too_big_for_the_servers_memory_is_one_line_before_loading(monkeypatch) -> None:
    """The weights' offloaded share against the devices' free memory (pure logic: the memory figures are given)."""
    from types import SimpleNamespace

    from backends import llama_rpc
    from models.errors import ModelError

    free = {1: 300 << 20, 2: 200 << 20}  # two RPC devices
    monkeypatch.setattr(llama_rpc, "ggml", lambda: SimpleNamespace(dev_info=lambda d: SimpleNamespace(free=free[d])))
    info = SimpleNamespace(path="big.gguf", block_count=9, size_bytes=1000 << 20)  # 10 offloadable layers
    endpoints = ["10.0.0.2:50052", "10.0.0.3:50052"]
    with pytest.raises(ModelError) as e:
        llama_rpc.check_rpc_memory(info, -1, [1, 2], endpoints)
    message = str(e.value)
    assert "\n" not in message and "every layer need about 1000 MiB" in message and "500 MiB free" in message
    assert "10.0.0.2:50052, 10.0.0.3:50052, which have" in message and "lower -ngl" in message
    llama_rpc.check_rpc_memory(info, 4, [1, 2], endpoints)  # 4 of 10 layers: 400 MiB fits in 500
    with pytest.raises(ModelError, match="6 of 10 layers need about 600 MiB"):
        llama_rpc.check_rpc_memory(info, 6, [1, 2], endpoints)
    with pytest.raises(ModelError, match="10.0.0.2:50052 and this machine's GPUs, which have 500 MiB free"):
        llama_rpc.check_rpc_memory(info, -1, [1, 2], endpoints[:1])  # one server, then a local GPU
