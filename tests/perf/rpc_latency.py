"""The target over llama.cpp RPC behind a simulated network: does speculation hide the round trip? (not a test)

    sudo python tests/perf/rpc_latency.py [--rtt 0,2,10] [--repeats 3] [-n 96] [--threads 1] [--server-threads 1]
                                          [--prompts story|builtin]

Needs root and iproute2 (`ip`, `tc`). It creates two network namespaces of its
own, joined by a veth pair (10.213.0.1 client, 10.213.0.2 server; the host's
own namespace and interfaces are never touched), runs `specchat rpc-server`
in one namespace and `specchat run -m demo -md demo-draft --rpc
10.213.0.2:50052` in the other, and delays every byte by half the round trip
in each direction: with `tc qdisc ... netem delay` on both veth ends where the
kernel has netem (sch_netem), else (`--delay-by proxy`, or automatically)
with a relay in the server's namespace that forwards each chunk half a round
trip after it arrived, in order, both ways (the server then listens on the
namespace's loopback and the relay on 10.213.0.2:50052). It then
measures `ar`, `sps` and `auto` (when this specchat has it) at each round trip,
interleaved, greedy, on the Gemma 3 270M demo pair (built on first use), on
one story prompt or (`--prompts builtin`) on each prompt of the bench's
builtin set, whose categories differ in how much speculation pays. The
server keeps the weights it receives (`--cache`), so after the first load
each run sends only hashes for the big tensors. `auto` measures the device's
costs once per round trip (an unrecorded warm-up run; each round trip has its
own cost file) since its choices depend on them.

Reported per round trip: tokens/s (decoding, from the run's stats; median of
the repeats and prompts), the speedup over `ar` (median of the ratios of the
same repeat and prompt; with `--prompts builtin` also per category),
acceptance, and bytes on the veth per target forward pass (both directions,
from the client namespace's /proc/net/dev between the run's `prefilled` and
`done` events). The namespaces are deleted at the end, also on failure or
Ctrl-C.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORY = "Once upon a time, in a small village,"
SUFFIX = str(os.getpid())
NS_CLIENT, NS_SERVER = f"specchat-rpc-cli-{SUFFIX}", f"specchat-rpc-srv-{SUFFIX}"
VETH_CLIENT, VETH_SERVER = "rpc-cli", "rpc-srv"  # they exist only inside the two namespaces
ADDR_CLIENT, ADDR_SERVER, PORT = "10.213.0.1", "10.213.0.2", 50052


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def setup_network() -> None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("needs iproute2 (`ip` and `tc`): apt-get install -y iproute2")
    sh("ip", "netns", "add", NS_CLIENT)
    sh("ip", "netns", "add", NS_SERVER)
    # The pair is created inside the client namespace, its peer straight into the server's.
    sh("ip", "-n", NS_CLIENT, "link", "add", VETH_CLIENT, "type", "veth", "peer", "name", VETH_SERVER,
       "netns", NS_SERVER)
    for ns, dev, addr in ((NS_CLIENT, VETH_CLIENT, ADDR_CLIENT), (NS_SERVER, VETH_SERVER, ADDR_SERVER)):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "set", dev, "up")


def set_netem(rtt_ms: float, check: bool = True) -> bool:
    """netem on both ends, half the round trip each (netem delays what leaves an interface); False without netem."""
    for ns, dev in ((NS_CLIENT, VETH_CLIENT), (NS_SERVER, VETH_SERVER)):
        r = subprocess.run(in_ns(ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                                 f"{rtt_ms / 2:g}ms", "limit", "100000"), capture_output=True, text=True)
        if r.returncode != 0:
            if check:
                raise RuntimeError(f"tc netem failed: {r.stderr.strip()}")
            return False
    return True


class Relay:
    """This script as a delaying TCP relay (see relay()), run in the server's namespace."""

    def __init__(self, rtt_ms: float, listen: str, target: str) -> None:
        self.proc = subprocess.Popen(
            in_ns(NS_SERVER, sys.executable, str(Path(__file__).resolve()), "--relay", listen, target,
                  f"{rtt_ms / 2}"), stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the relay did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def relay(listen: str, target: str, one_way_ms: float) -> None:
    """Forward every connection to `target`, each chunk `one_way_ms` after it arrived, in order, both ways."""
    delay = one_way_ms / 1000

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        queue: collections.deque = collections.deque()
        ready = threading.Condition()

        def send() -> None:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, data = queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    if data:
                        dst.sendall(data)
                    else:
                        dst.shutdown(socket.SHUT_WR)
                        return
                except OSError:
                    return

        threading.Thread(target=send, daemon=True).start()
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            with ready:
                queue.append((time.monotonic() + delay, data))
                ready.notify()
            if not data:
                return

    host, port = listen.rsplit(":", 1)
    thost, tport = target.rsplit(":", 1)
    server = socket.create_server((host, int(port)), reuse_port=False)
    print("ready", flush=True)
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection((thost, int(tport)))
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()


def teardown_network() -> None:
    for ns in (NS_CLIENT, NS_SERVER):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def veth_bytes(pid: int) -> int:
    """Bytes received + sent on the client's veth, read in the client process's own namespace."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == VETH_CLIENT:
                fields = rest.split()
                return int(fields[0]) + int(fields[8])
    raise RuntimeError(f"{VETH_CLIENT} not found in /proc/{pid}/net/dev")


class Server:
    def __init__(self, host: str, threads: int, cache: Path, log: Path) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                in_ns(NS_SERVER, sys.executable, "-m", "app", "rpc-server", "--host", host, "--port", str(PORT),
                      "-t", str(threads), "--cache", str(cache)),
                stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + 120
        while "specchat rpc-server: serving" not in log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the RPC server did not start:\n{log.read_text(errors='replace')}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def run_once(strategy: str, prompt: str, args: argparse.Namespace, cost_file: Path) -> dict:
    cmd = in_ns(NS_CLIENT, sys.executable, "-m", "app", "run", prompt, "-m", "demo", "-md", "demo-draft",
                "-s", strategy, "--temp", "0", "-n", str(args.n_predict), "-t", str(args.threads), "--json",
                "--rpc", f"{ADDR_SERVER}:{PORT}", *(["-ngl", str(args.ngl)] if args.ngl else []))
    env = dict(os.environ, SPECCHAT_COST_CACHE=str(cost_file))
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    bytes_at_prefill = None
    done = None
    assert proc.stdout is not None
    for line in proc.stdout:
        event = json.loads(line)
        if event["type"] == "prefilled":
            bytes_at_prefill = veth_bytes(proc.pid)
        elif event["type"] == "done":
            done = event
            bytes_at_done = veth_bytes(proc.pid)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait(timeout=600) != 0 or done is None or bytes_at_prefill is None:
        raise RuntimeError(f"{strategy} failed (exit {proc.returncode}): {err.strip()}")
    stats = done["stats"]
    return {
        "strategy": strategy, "tok_s": stats["tokens_per_second"], "tokens": done["tokens"],
        "forwards": stats["target_forwards"], "acceptance": stats.get("acceptance_rate"),
        "bytes_per_forward": (bytes_at_done - bytes_at_prefill) / max(1, stats["target_forwards"]),
        "wall_s": time.monotonic() - started,
    }


def has_auto() -> bool:
    r = subprocess.run([sys.executable, "-m", "app", "run", "--help"], capture_output=True, text=True, cwd=ROOT)
    return "auto" in r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt", default="0,2,10", help="round trips in ms (default: 0,2,10)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="client threads (the draft, the embeddings)")
    ap.add_argument("--server-threads", type=int, default=1, help="RPC server threads (the target's layers)")
    ap.add_argument("-ngl", "--gpu-layers", dest="ngl", type=int, default=0,
                    help="target layers on the server, the output layer counted first (default: all; the demo "
                         "target's 18 keeps its first layer on the client)")
    ap.add_argument("--prompts", choices=("story", "builtin"), default="story",
                    help="one story prompt, or each prompt of the bench's builtin set")
    ap.add_argument("--strategies", default=None, help="default: ar,sps and auto when this specchat has it")
    ap.add_argument("--delay-by", choices=("auto", "netem", "proxy"), default="auto",
                    help="netem on the veth ends, or the relay (auto: netem when the kernel has it)")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    ap.add_argument("--relay", nargs=3, metavar=("LISTEN", "TARGET", "ONE_WAY_MS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.relay:
        relay(args.relay[0], args.relay[1], float(args.relay[2]))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces and netem)")
    strategies = args.strategies.split(",") if args.strategies else ["ar", "sps"] + (["auto"] if has_auto() else [])
    prompts = [("story", STORY)]
    if args.prompts == "builtin":
        from app.bench.prompts import load_prompt_set
        prompts = [(p.category, p.text) for p in load_prompt_set("builtin")]
    rtts = [float(r) for r in args.rtt.split(",")]
    # The demo pair is built (once) outside the namespaces, before anything is timed.
    subprocess.run([sys.executable, "-c", "import sys; from app.loading import quantize; from models.demo import "
                    "ensure_demo_pair; ensure_demo_pair(lambda m: print(m, file=sys.stderr), quantize)"],
                   check=True, cwd=ROOT)
    work = Path(tempfile.mkdtemp(prefix="specchat-rpc-latency-"))
    server = None
    results: list[dict] = []
    relay_proc = None
    try:
        setup_network()
        use_netem = args.delay_by == "netem" or (args.delay_by == "auto" and set_netem(0, check=False))
        print(f"delaying with {'netem' if use_netem else 'the relay (no netem in this kernel)'}", file=sys.stderr)
        server = Server(ADDR_SERVER if use_netem else "127.0.0.1", args.server_threads, work / "cache",
                        work / "server.log")
        for rtt in rtts:
            if use_netem:
                set_netem(rtt)
            else:
                if relay_proc is not None:
                    relay_proc.stop()
                relay_proc = Relay(rtt, f"{ADDR_SERVER}:{PORT}", f"127.0.0.1:{PORT}")
            cost_file = work / f"device-cost-{rtt:g}ms.json"
            # Unrecorded: fills the server's weight cache (first load) and auto's costs at this round trip.
            run_once("auto" if "auto" in strategies else strategies[0], prompts[0][1], args, cost_file)
            for repeat in range(args.repeats):
                for n, (category, prompt) in enumerate(prompts):
                    for strategy in strategies:
                        r = run_once(strategy, prompt, args, cost_file) | {
                            "rtt_ms": rtt, "repeat": repeat, "prompt": n, "category": category}
                        results.append(r)
                        print(f"rtt {rtt:g} ms  repeat {repeat}  {category:13s} {strategy:5s} {r['tok_s']:6.2f} tok/s  "
                              f"{r['forwards']} forwards  {r['bytes_per_forward'] / 1024:.1f} KiB/forward",
                              file=sys.stderr, flush=True)
    finally:
        for proc in (relay_proc, server):
            if proc is not None:
                proc.stop()
        teardown_network()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report(results, strategies, rtts)
    return 0


def report(results: list[dict], strategies: list[str], rtts: list[float]) -> None:
    others = [s for s in strategies if s != "ar"]
    head = ["RTT", *(f"`{s}` tok/s" for s in strategies), *(f"`{s}` vs `ar`" for s in others),
            *(f"`{s}` acceptance" for s in others if s == "sps"), *(f"`{s}` KiB/forward" for s in strategies)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))

    def ratios(s: str, rows: list[dict]) -> list[float]:
        """`s` against `ar` on the same round trip, repeat and prompt."""
        ar = {(r["rtt_ms"], r["repeat"], r["prompt"]): r["tok_s"] for r in rows if r["strategy"] == "ar"}
        return [r["tok_s"] / ar[k] for r in rows if r["strategy"] == s
                and (k := (r["rtt_ms"], r["repeat"], r["prompt"])) in ar]

    for rtt in rtts:
        rows = [r for r in results if r["rtt_ms"] == rtt]
        by = {s: [r for r in rows if r["strategy"] == s] for s in strategies}
        cells = [f"{rtt:g} ms"]
        cells += [f"{statistics.median(r['tok_s'] for r in by[s]):.2f}" for s in strategies]
        for s in others:
            rs = ratios(s, rows)
            cells.append(f"{statistics.median(rs):.2f}" if rs else "")
        cells += [f"{statistics.median(r['acceptance'] or 0 for r in by[s]):.2f}" for s in others if s == "sps"]
        cells += [f"{statistics.median(r['bytes_per_forward'] for r in by[s]) / 1024:.1f}" for s in strategies]
        print("| " + " | ".join(cells) + " |")
    categories = list(dict.fromkeys(r["category"] for r in results))
    if len(categories) > 1 and others:
        print("\nper category, against `ar` (median over repeats and the category's prompts):")
        for rtt in rtts:
            for s in others:
                cells = []
                for c in categories:
                    rs = ratios(s, [r for r in results if r["rtt_ms"] == rtt and r["category"] == c])
                    cells.append(f"{c} {statistics.median(rs):.2f}" if rs else f"{c} -")
                print(f"  {rtt:g} ms {s}: " + ", ".join(cells))
    # Greedy: every run of a prompt must give the same tokens, whatever the strategy and round trip.
    first: dict[int, list] = {}
    same = all(first.setdefault(r["prompt"], r["tokens"]) == r["tokens"] for r in results)
    print(f"\nevery run's output equal to the first run's of the same prompt: {same}")


if __name__ == "__main__":
    sys.exit(main())
