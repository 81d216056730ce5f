"""`auto` against `ar` on a fresh engine, two checkouts of specchat alternated (not a test: a measurement).

Each repeat runs `specchat bench --clients` once in a new process for each
checkout (`--base`, e.g. a `git worktree` of an older commit, and this one),
in alternating order: a new process learns afresh (`bench` starts from
nothing learnt), so this is what a fresh install's first requests see. Each
run's figure is auto's tokens per second against ar's in the same run; the
medians over repeats are printed per checkout.

    git worktree add /tmp/base 335e76d
    python tests/perf/auto_fresh_ab.py --base /tmp/base --clients 4 --temp 0.8 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ratio(root: Path, args: argparse.Namespace) -> float:
    """auto / ar of one bench run of the checkout at `root`."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "app", "bench", "-m", args.model, "-md", args.draft, "-s", "ar,auto",
                        "--prompts", "chat", "--clients", str(args.clients), "--requests", str(args.requests),
                        "-n", str(args.n), "--temp", str(args.temp), "--seed", "1", "--repeats", "1",
                        "-t", str(args.threads), "--out", out],
                       check=True, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = {row["strategy"]: row for row in json.loads((Path(out) / "bench.json").read_text())["load"]}
        return float(rows["auto"]["speedup_vs_ar"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (a git worktree)")
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-md", "--draft", default="smollm2-draft")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    got: dict[str, list[float]] = {"base": [], "this": []}
    for rep in range(args.repeats):
        order = [("base", args.base), ("this", ROOT)]
        for name, root in order if rep % 2 == 0 else order[::-1]:
            got[name].append(ratio(root, args))
            print(f"repeat {rep + 1}, {name}: auto / ar {got[name][-1]:.3f}", flush=True)
    for name, values in got.items():
        print(f"{name}: median {statistics.median(values):.3f} ({' / '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
