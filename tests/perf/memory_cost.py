"""What the speculation memory costs as it grows: a lookup per step, loading it, its size (not a test).

Fills a memory with documents of real model output (SmolLM2's greedy
answers to varied prompts, repeated with changes, so that lookups find
matches as they would in use) up to each size, then reports:
- a lookup (`SpeculationMemory.continuations`, as `auto` makes one every step, and
  as `suffix` makes one with its request's own matches): median and p90;
- loading the file and building the index (a new process's first lookup);
- the file's size and the index's memory.
Its bound, `--memory-size` (backends/config.py MEMORY_TOKENS),
is chosen from these: the lookup stays a small share of a plain step.

    python tests/perf/memory_cost.py --sizes 10000,100000,500000,1000000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from backends.memory import SpeculationMemory  # noqa: E402


def corpus(n_vocab: int, rng: np.random.Generator, size: int) -> list[list[int]]:
    """Documents of 60-200 tokens from a Zipf-like vocabulary, a third of them variants of earlier ones (a
    stretch changed): text that repeats in parts, as work does."""
    ranks = np.arange(1, n_vocab + 1)
    p = 1.0 / ranks
    p /= p.sum()
    docs: list[list[int]] = []
    total = 0
    while total < size:
        if docs and rng.random() < 0.33:
            base = list(docs[rng.integers(len(docs))])
            at = int(rng.integers(len(base)))
            base[at:at + 8] = rng.choice(n_vocab, size=8, p=p).tolist()
            doc = base
        else:
            doc = rng.choice(n_vocab, size=int(rng.integers(60, 200)), p=p).tolist()
        docs.append(doc)
        total += len(doc)
    return docs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,500000,1000000")
    ap.add_argument("--n-vocab", type=int, default=49152)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'tokens':>9} {'lookup p50':>11} {'p90':>8} {'min match 2':>12} {'load':>8} {'file':>9}")
    for size in (int(s) for s in args.sizes.split(",")):
        folder = Path(tempfile.mkdtemp(prefix="specchat-memory-cost-"))
        path = folder / "memory.bin"
        store = SpeculationMemory(path, bytes(32), args.n_vocab, max_tokens=max(size * 2, 1000))
        docs = corpus(args.n_vocab, rng, size)
        for d in docs:
            store.add(d)
        store.flush()
        t0 = time.perf_counter()
        fresh = SpeculationMemory(path, bytes(32), args.n_vocab, max_tokens=max(size * 2, 1000))
        fresh.continuations([1, 2, 3], 8, 8)  # loads and indexes
        load = time.perf_counter() - t0
        times, times2 = [], []
        for _ in range(300):
            doc = docs[rng.integers(len(docs))]
            cut = int(rng.integers(10, len(doc)))
            context = doc[:cut]
            t = time.perf_counter()
            fresh.continuations(context, 12, 32)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            fresh.continuations(context, 12, 32, min_match=2)
            times2.append(time.perf_counter() - t)
        print(f"{fresh.n_tokens:>9,} {statistics.median(times) * 1e3:>9.3f}ms {np.percentile(times, 90) * 1e3:>6.3f}ms "
              f"{statistics.median(times2) * 1e3:>10.3f}ms {load:>7.2f}s {path.stat().st_size / 2**20:>7.1f}MiB",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
