"""llama.cpp's CPU threads when a second thread takes over the decoding (backends.llama_process.release_compute_threads).

ggml runs each graph as an OpenMP parallel region of the decoding thread, and
libgomp keeps a team of workers for each thread that ever ran one; with more
managed threads than CPUs it throttles, and every barrier of every decode
sleeps and wakes instead of spinning. `specchat serve` warms up on its main
thread and decodes on its engine thread: these tests decode on a second thread
while the first one's team lives, count the second thread's voluntary context
switches per decode (Linux's /proc), and check that releasing the first team
brings them down to about none, and that the server does so.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from backends.llama import Batch, ContextConfig, LlamaContext, LlamaModel
from backends.llama_process import _openmp, release_compute_threads

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
DECODES = 40

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts context switches in Linux's /proc"),
    pytest.mark.skipif(CPUS < 2, reason="one CPU: libgomp never runs a team of workers"),
]


def _switches() -> int:
    """The calling thread's voluntary context switches so far."""
    status = Path(f"/proc/self/task/{threading.get_native_id()}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches"))


def _decode(ctx: LlamaContext, n: int) -> None:
    batch = Batch(8)
    ctx.clear()
    for pos in range(n):
        batch.clear()
        batch.add(3 + pos % 20, pos, (0,), logits=True)
        ctx.decode(batch)
        ctx.logits(0)
    batch.close()


def _switches_per_decode_on_another_thread(ctx: LlamaContext) -> float:
    out: list[float] = []

    def run() -> None:
        _decode(ctx, 4)  # the thread's team starts
        before = _switches()
        _decode(ctx, DECODES)
        out.append((_switches() - before) / DECODES)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


@pytest.fixture(scope="module")
def ctx(tiny) -> LlamaContext:
    model = LlamaModel(tiny.target)
    context = LlamaContext(model, ContextConfig(n_ctx=256, n_threads=CPUS))
    yield context
    context.close()
    model.close()


@pytest.mark.skipif(_openmp() is None, reason="this llama.cpp build runs its CPU threads without libgomp")
def test_a_second_decoding_thread_sleeps_at_barriers_until_the_first_team_is_released(ctx):
    _decode(ctx, 4)  # this thread's team: what a server's warm-up on its main thread leaves
    throttled = _switches_per_decode_on_another_thread(ctx)
    assert throttled >= 2, f"expected libgomp to throttle with two teams: {throttled:.1f} switches per decode"
    release_compute_threads()
    released = _switches_per_decode_on_another_thread(ctx)
    assert released < 0.5, f"{released:.1f} voluntary context switches per decode after the release"
    _decode(ctx, 4)  # and this thread decodes again afterwards (a new team)
    release_compute_threads()


def test_the_server_decodes_without_sleeping_at_barriers(tiny, tmp_path):
    """`specchat serve -t <CPUs>`: its threads' voluntary context switches over a 64-token answer stay far below
    one per barrier (throttled, each decode of this model sleeps about ten times on each of its threads)."""
    from serve_helpers import start_server, stop_server

    served = start_server(["-m", str(tiny.target), "-s", "ar", "-np", "2"], tmp_path / "serve.log",
                          threads=str(CPUS))
    try:
        def total() -> int:
            n = 0
            for task in Path(f"/proc/{served.proc.pid}/task").iterdir():
                status = (task / "status").read_text()
                n += next(int(line.split()[1]) for line in status.splitlines()
                          if line.startswith("voluntary_ctxt_switches"))
            return n

        client = served.client()
        client.completions.create(model="target", prompt="a b", max_tokens=4, temperature=0)
        before = total()
        r = client.completions.create(model="target", prompt="a b c", max_tokens=64, temperature=0,
                                      extra_body={"ignore_eos": True})
        per_token = (total() - before) / r.usage.completion_tokens
    finally:
        stop_server(served)
    assert r.usage.completion_tokens == 64
    # No sleeping at barriers, and each token handed to the event loop with about one wake-up: 0.9-1.1 on asyncio's
    # loop (with h11 or httptools), 2.0-3.1 on uvloop's, which is why the server does not run on uvloop
    # (docs/results.md)
    assert per_token < 2, f"{per_token:.1f} voluntary context switches per token in the server"
