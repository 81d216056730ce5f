"""specchat serve against llama-server under concurrent clients, over HTTP, side by side (not a test).

Both servers load the same GGUF files with the same threads, slots and context
per slot, and are sent the same requests with the official `openai` client:
the chat prompt set through the template, streamed, `max_tokens` each, at the
given temperature (seeded per request). C clients each send their share of
the requests one after another (a closed loop), for each C; the servers take
turns going first for each C and repeat. Reported per server and C: aggregate
completion tokens per second over the wall time of all requests, p50/p95
time to first token (first content delta), the median over repeats, and each
server's ratio to the first server at the same C and repeat; beside them the
decode rate (each request's tokens after its first, over the time from its
first content to its last), which neither the prompt's evaluation nor the
answers' lengths move: at temperature > 0 the servers' answers differ in
length, and a shorter answer carries its prompt's cost over fewer tokens.

llama-server comes from ../shared/tools/build-llama-cpp-reference.sh (the
same vendored llama.cpp). Servers, with their flags:

    python tests/perf/serve_vs_llama_server.py --clients 1,2,4,8 --repeats 3 --temp 0.8 \\
        --server "specchat ar=-s ar" --server "specchat auto=-s auto" \\
        --server "llama-server=" --server "llama-server draft=-md DRAFT --spec-draft-n-max 6"

`--requests 24` sends 24 requests in all (the prompts in turn), so that the
clients stay busy instead of sending one wave whose slowest request sets the
end.

A server spec is NAME=FLAGS; a name starting with "llama-server" runs llama-server, any other specchat serve;
DRAFT in the flags is replaced by the draft file; a word env:KEY=VALUE sets an environment variable of that server
(e.g. env:PYTHONPATH=DIR to shadow a module); a word root:DIR runs specchat from another checkout (a worktree of
an earlier commit, for an A/B of the code).

For specchat the table also gives the CPU time its event loop's thread (the process's main thread: HTTP, the
stream's chunks) spent per completion token, from the kernel's schedstat: a figure the machine's speed moves
far less than tokens per second, and one that takes a core from llama.cpp's threads on a small machine:

    python tests/perf/serve_vs_llama_server.py --clients 1 --repeats 4 --requests 16 \
        --server "HEAD=-s ar root:/tmp/old" --server "new=-s ar"
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.bench.prompts import load_prompt_set  # noqa: E402
from models.resolve import resolve_model  # noqa: E402

MODEL_ID = ["model"]  # the target file's stem: specchat serve's model id (llama-server takes any)
STREAM = [True]  # --no-stream: whole answers
REFERENCE_BIN = Path(os.environ.get("SPECCHAT_REF_DIR", Path.home() / ".cache/specchat-reference")) / \
    "0.3.36/build/bin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, flags: str, target: Path, draft: Path, parallel: int, n_ctx: int, threads: int,
                 log_dir: Path) -> None:
        self.name = name
        self.port = _free_port()
        words = [a.replace("DRAFT", str(draft)) for a in flags.split()]
        extra_env = dict(w[4:].split("=", 1) for w in words if w.startswith("env:"))  # env:KEY=VALUE
        roots = [w[5:] for w in words if w.startswith("root:")]  # root:DIR
        args = [w for w in words if not w.startswith(("env:", "root:"))]
        if name.startswith("llama-server"):
            cmd = [str(REFERENCE_BIN / "llama-server"), "-m", str(target), "-np", str(parallel),
                   "-c", str(n_ctx * parallel), "-t", str(threads), "--port", str(self.port), "--host", "127.0.0.1",
                   *args]
            env = {**os.environ, "LD_LIBRARY_PATH": str(REFERENCE_BIN), **extra_env}
        else:
            cmd = [sys.executable, "-m", "app", "serve", "-m", str(target), "-md", str(draft), "-np", str(parallel),
                   "-c", str(n_ctx), "-t", str(threads), "--port", str(self.port), *args]
            env = {**os.environ, **extra_env}
        self.log = open(log_dir / f"{name.replace(' ', '_')}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=roots[-1] if roots else Path(__file__).resolve().parents[2])
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited: see {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"{name} did not start")

    def loop_cpu(self) -> float | None:
        """Seconds on a CPU of specchat's main thread (its event loop) so far; None for llama-server."""
        if self.name.startswith("llama-server"):
            return None
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=600)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one(client: openai.OpenAI, messages: list[dict], n: int, temp: float, seed: int) -> tuple[float, int, float]:
    """(time to first content, completion tokens, seconds from the first content to the last) of one streamed chat
    request; with STREAM[0] off, a whole answer's (its time for both)."""
    t0 = time.perf_counter()
    if not STREAM[0]:
        whole = client.chat.completions.create(model=MODEL_ID[0], messages=messages, max_tokens=n, temperature=temp,
                                               seed=seed)
        seconds = time.perf_counter() - t0
        return seconds, whole.usage.completion_tokens, seconds
    first = None
    last = 0.0
    tokens = 0
    stream = client.chat.completions.create(model=MODEL_ID[0], messages=messages, max_tokens=n, temperature=temp, seed=seed,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter() - t0
            if first is None:
                first = last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None:
        return time.perf_counter() - t0, tokens, 0.0
    return first, tokens, last - first


class Load(NamedTuple):
    """One load's figures: aggregate completion tok/s over its wall time, every request's TTFT, the decode rate
    (tokens after each request's first, over the time from its first content to its last: what the prompt and the
    answers' lengths do not move) and the mean completion tokens a request."""

    rate: float
    ttft: list[float]
    decode_rate: float
    mean_tokens: float
    loop_us: float | None  # specchat's event loop thread: CPU microseconds per completion token


def load(server: Server, requests: list[list[dict]], clients: int, n: int, temp: float) -> Load:
    """A load of `clients` closed-loop clients sending `requests`."""
    queue = list(range(len(requests)))
    lock = threading.Lock()
    ttft: list[float] = []
    total = [0]
    decoded = [0, 0.0]  # tokens after the first, and their seconds

    def client_loop() -> None:
        c = server.client()
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            t, k, d = one(c, requests[i], n, temp, seed=1000 + i)
            with lock:
                ttft.append(t)
                total[0] += k
                if k > 1:
                    decoded[0] += k - 1
                    decoded[1] += d

    t0, cpu0 = time.perf_counter(), server.loop_cpu()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu1 = server.loop_cpu()
    return Load(total[0] / (time.perf_counter() - t0), ttft, decoded[0] / decoded[1] if decoded[1] else 0.0,
                total[0] / max(len(ttft), 1),
                None if cpu0 is None or cpu1 is None else 1e6 * (cpu1 - cpu0) / max(total[0], 1))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2")
    ap.add_argument("-md", default="smollm2-draft")
    ap.add_argument("--server", action="append", required=True, help="NAME=FLAGS")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--requests", type=int, default=None,
                    help="N requests in all, the prompts in turn (default: each prompt once: one wave at C = limit)")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--no-stream", action="store_true",
                    help="whole answers (no time to first token; the decode rate then holds the prompt)")
    ap.add_argument("-c", type=int, default=4096, help="context per slot")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    target, draft = resolve_model(args.m), resolve_model(args.md)
    MODEL_ID[0] = target.stem
    STREAM[0] = not args.no_stream
    requests = [[{"role": m.role, "content": m.content} for m in p.messages] or [{"role": "user", "content": p.chat_text()}]
                for p in load_prompt_set("chat", args.limit)]
    if args.requests is not None:  # clients kept busy, as a server in steady use (each request its own seed)
        requests = [requests[i % len(requests)] for i in range(args.requests)]
    log_dir = Path(tempfile.mkdtemp(prefix="serve-vs-"))
    specs = [s.split("=", 1) for s in args.server]
    results: dict[tuple[str, int], list[Load]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    decode_ratios: dict[tuple[str, int], list[float]] = {}
    for c in clients:
        servers = [Server(name, flags, target, draft, max(clients), args.c, args.t, log_dir) for name, flags in specs]
        try:
            for s in servers:  # warm-up
                load(s, requests[:c], c, 8, args.temp)
            for rep in range(args.repeats):
                order = servers[rep % len(servers):] + servers[:rep % len(servers)]
                got = {}
                for s in order:
                    got[s.name] = load(s, requests, c, args.n, args.temp)
                    results.setdefault((s.name, c), []).append(got[s.name])
                    loop = got[s.name].loop_us
                    print(f"{c} clients, repeat {rep + 1}, {s.name}: {got[s.name].rate:.1f} tok/s, decode "
                          f"{got[s.name].decode_rate:.1f} tok/s, {got[s.name].mean_tokens:.1f} tokens a request"
                          + ("" if loop is None else f", event loop {loop:.0f} us a token"), file=sys.stderr)
                for s in servers:
                    ratios.setdefault((s.name, c), []).append(got[s.name].rate / got[servers[0].name].rate)
                    decode_ratios.setdefault((s.name, c), []).append(
                        got[s.name].decode_rate / (got[servers[0].name].decode_rate or 1.0))
        finally:
            for s in servers:
                s.stop()
    print(f"{'server':22} {'clients':>7} {'tok/s in all':>12} {'vs ' + specs[0][0]:>16} {'decode tok/s':>12} "
          f"{'vs ' + specs[0][0]:>16} {'tokens/req':>10} {'TTFT p50':>9} {'TTFT p95':>9} {'loop us/tok':>11}")
    for (name, c), runs in results.items():
        agg = statistics.median(r.rate for r in runs)
        ttft = [t for r in runs for t in r.ttft]
        loops = [r.loop_us for r in runs if r.loop_us is not None]
        print(f"{name:22} {c:>7} {agg:>12.1f} {statistics.median(ratios[(name, c)]):>15.2f}x "
              f"{statistics.median(r.decode_rate for r in runs):>12.1f} {statistics.median(decode_ratios[(name, c)]):>15.2f}x "
              f"{statistics.mean(r.mean_tokens for r in runs):>10.1f} {pct(ttft, 50):>8.3f}s {pct(ttft, 95):>8.3f}s "
              + (f"{statistics.median(loops):>11.0f}" if loops else f"{'-':>11}"))
    print(f"logs in {log_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
