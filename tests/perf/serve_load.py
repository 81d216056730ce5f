"""Load on `specchat serve`: concurrent streamed clients against one engine (not a test: a measurement).

Starts the server on the demo pair on 127.0.0.1 (a free port, loopback only),
then:
1. runs every prompt once, one at a time, at temperature 0: the reference texts;
2. phase A: `--clients` threads x `--per-client` streamed requests at once
   (the server decodes up to --parallel of them together, the rest wait FIFO), each output checked
   against its reference; p50/p95 time to first token and total latency. A share of them
   (`--faults`) are faults: a stream the client drops after two chunks, or an invalid request
   (which must get a 400);
3. phase B: more of the same until `--requests` requests in all, then the
   server's resident memory (VmRSS in /proc/PID/status) against what it was
   after step 1: a leak per request would show here;
4. the slots: none running, no cache found inconsistent after a generation (`kv_errors`), and the
   cells llama.cpp holds equal to those the slots' records account for (`kv_cells` == `kv_cached`:
   no cell leaked).
Every request is bounded by a timeout and the whole run by `--max-seconds`;
the server is stopped with Ctrl-C (SIGINT) at the end and must exit 0.

    python tests/perf/serve_load.py                       # 8 x 10 (20% faults), 500 requests, 8 tokens, sps, -np 4
    python tests/perf/serve_load.py --requests 200 --max-tokens 16 --strategy lookup
"""

from __future__ import annotations

import argparse
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

PROMPTS = (
    "Once upon a time, in a small village,",
    "The history of the Roman Empire began",
    "def quicksort(arr):\n",
    "The capital of France is",
    "Photosynthesis is the process by which",
    "To make a cup of tea, first",
    "The three laws of motion are",
    "In 1969, the first humans",
)


@dataclass(frozen=True)
class Outcome:
    prompt: int
    text: str
    ttft: float  # seconds to the first chunk with text
    total: float
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS line")


def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "app", "serve", "-m", "demo", "-md", "demo-draft", "-s", args.strategy,
           "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads), "--temp", "0",
           "-np", str(args.parallel)]
    print("server:", " ".join(cmd[1:]), file=sys.stderr)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # the demo pair is built on first use
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not come up")


def one_request(client: openai.OpenAI, prompt: int, max_tokens: int) -> Outcome:
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    try:
        for chunk in client.completions.create(model="demo", prompt=PROMPTS[prompt], max_tokens=max_tokens,
                                               temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk.choices[0].text)
    except (openai.APIError, httpx.HTTPError) as e:
        return Outcome(prompt, "".join(parts), ttft or 0.0, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    total = time.perf_counter() - t0
    return Outcome(prompt, "".join(parts), total if ttft is None else ttft, total)


def fault(url: str, client: openai.OpenAI, prompt: int, rng: random.Random) -> str | None:
    """A dropped stream (two chunks, then the client goes) or an invalid request; what went wrong, if anything."""
    if rng.random() < 0.5:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[prompt], "temperature": -1}, timeout=60)
        return None if r.status_code == 400 else f"an invalid request answered {r.status_code}"
    try:
        stream = client.completions.create(model="demo", prompt=PROMPTS[prompt], max_tokens=2000, temperature=0,
                                           stream=True)
        it = iter(stream)
        next(it), next(it)
        stream.close()
    except (openai.APIError, httpx.HTTPError, StopIteration) as e:
        return f"a stream to drop failed first: {e!r}"
    return None


def concurrent(url: str, clients: int, n_requests: int, max_tokens: int, first: int, deadline: float,
               faults: float = 0.0) -> tuple[list[Outcome], list[str]]:
    """`n_requests` streamed requests from `clients` threads at once; prompt i = request number mod prompts; a
    share `faults` of them are faults instead (`fault`). The valid requests' outcomes and what faults broke."""
    outcomes: list[Outcome] = []
    broken: list[str] = []
    lock = threading.Lock()
    counter = iter(range(first, first + n_requests))

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        while time.monotonic() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            if rng.random() < faults:
                problem = fault(url, client, i % len(PROMPTS), rng)
                if problem:
                    with lock:
                        broken.append(problem)
                continue
            outcome = one_request(client, i % len(PROMPTS), max_tokens)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, broken


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def check(outcomes: list[Outcome], reference: list[str], label: str) -> int:
    errors = [o for o in outcomes if o.error]
    mismatches = [o for o in outcomes if not o.error and o.text != reference[o.prompt]]
    ttft = [o.ttft * 1e3 for o in outcomes if not o.error]
    total = [o.total * 1e3 for o in outcomes if not o.error]
    print(f"{label}: {len(outcomes)} requests, {len(errors)} errors, {len(mismatches)} outputs differing from the "
          f"sequential run")
    if ttft:
        print(f"  time to first token ms: p50 {percentile(ttft, 50):.0f}, p95 {percentile(ttft, 95):.0f}, "
              f"max {max(ttft):.0f}")
        print(f"  total latency ms:       p50 {percentile(total, 50):.0f}, p95 {percentile(total, 95):.0f}, "
              f"max {max(total):.0f}")
    for o in (errors + mismatches)[:3]:
        print(f"  e.g. prompt {o.prompt}: {o.error or repr(o.text)} (expected {reference[o.prompt]!r})")
    return len(errors) + len(mismatches)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default: 8)")
    p.add_argument("--per-client", type=int, default=10, help="phase A: streamed requests per client (default: 10)")
    p.add_argument("--requests", type=int, default=500, help="requests in all, for the memory check (default: 500)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per request (default: 8)")
    p.add_argument("--strategy", default="sps", help="the server's strategy (default: sps)")
    p.add_argument("-t", "--threads", type=int, default=2, help="the server's CPU threads (default: 2)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="the server's parallel slots (default: 4)")
    p.add_argument("--faults", type=float, default=0.2,
                   help="phase A: share of requests that are dropped streams or invalid (default: 0.2)")
    p.add_argument("--max-seconds", type=float, default=1500, help="stop sending requests after this (default: 1500)")
    args = p.parse_args()

    log = Path(tempfile.mkdtemp(prefix="specchat-serve-load-")) / "server.log"
    proc, url = start(args, log)
    failures = 0
    t_start = time.monotonic()
    deadline = t_start + args.max_seconds
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        reference = [one_request(client, i, args.max_tokens) for i in range(len(PROMPTS))]
        failures += sum(o.error is not None for o in reference)
        texts = [o.text for o in reference]
        seq = [o.total * 1e3 for o in reference]
        print(f"sequential: {len(reference)} requests, latency ms p50 {percentile(seq, 50):.0f}, "
              f"max {max(seq):.0f}")
        rss_before = rss_kib(proc.pid)
        n_a = args.clients * args.per_client
        a, broken = concurrent(url, args.clients, n_a, args.max_tokens, 0, deadline, args.faults)
        failures += check(a, texts, f"phase A ({args.clients} clients x {args.per_client}, "
                                    f"{n_a - len(a)} of them faults)") + len(broken)
        for problem in broken[:3]:
            print(f"  fault: {problem}")
        rss_a = rss_kib(proc.pid)
        n_b = max(0, args.requests - len(reference) - n_a)
        b, _ = concurrent(url, args.clients, n_b, args.max_tokens, n_a, deadline)
        failures += check(b, texts, f"phase B ({args.clients} clients)")
        rss_after = rss_kib(proc.pid)
        served = len(reference) + n_a + len(b)
        if served < args.requests:
            print(f"stopped early at {served} requests: --max-seconds {args.max_seconds:g} reached")
            failures += 1
        while (health := httpx.get(f"{url}/health", timeout=10).json())["running"] and time.monotonic() < deadline:
            time.sleep(0.1)  # dropped streams end within a step
        leaked = health["kv_cells"] != health["kv_cached"]
        print(f"slots: {health['running']} running, kv_errors {health['kv_errors']}, cells held "
              f"{health['kv_cells']}, accounted for {health['kv_cached']}{' (LEAKED)' if leaked else ''}")
        failures += bool(health["running"] or health["kv_errors"] or leaked)
        print(f"server RSS: {rss_before / 1024:.1f} MiB after the sequential runs, {rss_a / 1024:.1f} MiB after "
              f"phase A, {rss_after / 1024:.1f} MiB after {served} requests "
              f"({(rss_after - rss_before) / 1024:+.1f} MiB); server handled {health['handled']}, "
              f"cancelled {health['cancelled']}")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
    print(f"server stopped with exit code {code}; wall time {time.monotonic() - t_start:.0f} s; log: {log}")
    return 1 if failures or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
