"""Fairness under load: a 3,000-token prompt arrives while other clients stream (not a test: a measurement).

Starts `specchat serve` (SmolLM2 pair by default, `-np` slots), lets
`--clients` - 1 clients stream long answers, and once they all stream, a last
client sends a prompt of about `--prompt-tokens` tokens. The server decodes a
prompt beside running sequences in chunks of half a batch (`-b` / 2), so each
running stream should get a token every step while the long prompt goes in:
it never waits for the whole prompt, only for one chunk's step. Reported,
from the chunks' arrival times at the clients:

- the long prompt's time to first token, and how many chunks it took;
- for each running stream, the tokens it got while that prompt was going in
  and its longest wait between two tokens in that window, against its
  median wait before the prompt came and against the prompt's time per chunk;
- p50/p95 time to first token of all requests.

    python tests/perf/serve_fair.py                  # 8 clients, 3000-token prompt, -np 8, 2 threads
    python tests/perf/serve_fair.py -s auto --temp 0.8

Fails (exit 1) when a running stream got fewer tokens in the window than
the prompt had chunks less one, i.e. when it waited for more than one chunk
between tokens somewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from app.bench.prompts import load_prompt_set  # noqa: E402

LONG_TEXT = ("The committee met on a grey morning to review the harbour's records, ledger by ledger: arrivals, "
             "cargo, tolls paid and owed, the names of the pilots who brought each ship in, and the weather. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "app", "serve", "-m", args.m, "-md", args.md, "-s", args.s, "-np", str(args.np),
           "-c", str(args.c), "-b", str(args.b), "-t", str(args.t), "--host", "127.0.0.1", "--port", str(port)]
    print("server:", " ".join(cmd[1:]), file=sys.stderr)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not come up")


def stream(url: str, path: str, body: dict, sent: float) -> list[float]:
    """Arrival times (since `sent`) of the chunks that carry text."""
    times: list[float] = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                times.append(time.perf_counter() - sent)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2")
    ap.add_argument("-md", default="smollm2-draft")
    ap.add_argument("-s", default="ar", help="the server's strategy (default: ar)")
    ap.add_argument("--clients", type=int, default=8, help="clients in all, the long prompt's included")
    ap.add_argument("-np", type=int, default=8)
    ap.add_argument("-c", type=int, default=4096, help="context per slot")
    ap.add_argument("-b", type=int, default=512, help="batch size (a prompt chunk beside others is half of it)")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("-n", type=int, default=400, help="tokens each running stream asks for")
    ap.add_argument("--temp", type=float, default=0.0)
    args = ap.parse_args()

    log = Path(tempfile.mkdtemp(prefix="specchat-fair-")) / "server.log"
    proc, url = start(args, log)
    failed = False
    try:
        prompts = [p.chat_text() for p in load_prompt_set("chat")]
        runners = args.clients - 1
        t0 = time.perf_counter()
        arrivals: list[list[float] | None] = [None] * runners
        sent_at = [0.0] * runners

        def run(i: int) -> None:
            sent_at[i] = time.perf_counter() - t0
            body = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": args.n,
                    "temperature": args.temp, "seed": i, "ignore_eos": True}
            arrivals[i] = [sent_at[i] + t for t in stream(url, "/v1/chat/completions", body, time.perf_counter())]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(runners)]
        for th in threads:
            th.start()
        while httpx.get(f"{url}/health", timeout=5).json()["running"] < runners:
            time.sleep(0.05)
        time.sleep(1.0)  # every runner streams
        long_prompt = LONG_TEXT * math.ceil(args.prompt_tokens / 40)
        tokens = httpx.post(f"{url}/tokenize", json={"content": long_prompt}, timeout=30)
        if tokens.status_code == 200:
            long_prompt_ids = tokens.json()["tokens"][: args.prompt_tokens]
        else:  # no /tokenize: cut by words, about 1.3 tokens each
            long_prompt_ids = None
            long_prompt = " ".join(long_prompt.split()[: int(args.prompt_tokens / 1.3)])
        sent = time.perf_counter() - t0
        body = {"prompt": long_prompt_ids or long_prompt, "max_tokens": 8, "temperature": 0}
        long_times = [sent + t for t in stream(url, "/v1/completions", body, time.perf_counter())]
        for th in threads:
            th.join()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()

    first = long_times[0]
    n_prompt = len(long_prompt_ids) if long_prompt_ids else args.prompt_tokens
    chunks = math.ceil(n_prompt / (args.b // 2))
    print(f"long prompt: ~{n_prompt} tokens in {chunks} chunks of {args.b // 2}; sent at {sent:.2f} s, first token "
          f"{first - sent:.2f} s later ({(first - sent) / chunks * 1e3:.0f} ms per chunk)")
    print(f"{'stream':>6} {'tokens in window':>16} {'longest wait':>13} {'median wait before':>19}")
    for i, times in enumerate(arrivals):
        assert times is not None
        gaps_before = [b - a for a, b in zip(times, times[1:]) if b < sent]
        window = [t for t in times if sent <= t <= first]
        edges = [max([t for t in times if t < sent], default=sent), *window,
                 min([t for t in times if t > first], default=first)]
        longest = max(b - a for a, b in zip(edges, edges[1:]))
        fair = len(window) >= chunks - 1
        failed |= not fair
        print(f"{i:>6} {len(window):>16} {longest * 1e3:>10.0f} ms {statistics.median(gaps_before) * 1e3:>16.0f} ms"
              f"{'' if fair else '   <- waited more than one chunk'}")
    ttft = sorted([t[0] - s for t, s in zip(arrivals, sent_at) if t] + [first - sent])
    print(f"time to first token: p50 {statistics.median(ttft):.3f} s, "
          f"p95 {ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]:.3f} s; log: {log}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
