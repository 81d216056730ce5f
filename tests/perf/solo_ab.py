"""One request alone, this code against an earlier commit: whole `specchat run` processes, interleaved (not a test).

The batching work moved every strategy onto the scheduler's decode path;
this checks that a lone request pays nothing for it. The earlier commit is
checked out in a temporary git worktree and run with this checkout's Python
environment, so both sides use the same llama.cpp build. For each prompt,
each strategy and each repeat, the two versions run back to back (which one
goes first alternates), each as a whole process, and the decode tokens/s of
their `--json` stats are compared; reported is each strategy's median of the
new/old ratios, with its spread. At temperature 0 the two outputs must be
the same tokens.

    python tests/perf/solo_ab.py --base b86674c -s ar,sps,lookup,lookahead,tree,auto --repeats 3 \\
        -- -m smollm2 -md smollm2-draft -n 128 -t 2 --temp 0
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
PROMPTS = (
    "Write two sentences about the sea.",
    "Explain in a few sentences why the sky is blue.",
    "Give three tips for writing clear code.",
)


def run(tree: Path, strategy: str, prompt: str, flags: list[str]) -> tuple[float, list[int]]:
    """(decode tokens/s, output tokens) of one `specchat run` process on the code in `tree`."""
    out = subprocess.run([sys.executable, "-m", "app", "run", prompt, "-s", strategy, "--json", *flags],
                         cwd=tree, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{tree.name}: {strategy} failed:\n{out.stderr[-2000:]}")
    done = json.loads(out.stdout.strip().splitlines()[-1])
    return float(done["stats"]["tokens_per_second"]), list(done["tokens"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier commit")
    ap.add_argument("-s", "--strategies", default="ar,sps,lookup,lookahead,tree,auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="after --: the flags of specchat run")
    args = ap.parse_args()
    flags = [f for f in args.flags if f != "--"]
    old = Path(tempfile.mkdtemp(prefix="specchat-base-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(old), args.base], cwd=ROOT, check=True,
                   capture_output=True)
    ratios: dict[str, list[float]] = {}
    differ: dict[str, int] = {}
    try:
        turn = 0
        for rep in range(args.repeats):
            for prompt in PROMPTS:
                for strategy in args.strategies.split(","):
                    sides = [(ROOT, "new"), (old, "old")]
                    if turn % 2:
                        sides.reverse()
                    turn += 1
                    got = {name: run(tree, strategy, prompt, flags) for tree, name in sides}
                    ratios.setdefault(strategy, []).append(got["new"][0] / got["old"][0])
                    differ[strategy] = differ.get(strategy, 0) + (got["new"][1] != got["old"][1])
                    print(f"repeat {rep + 1} {strategy:10} new {got['new'][0]:6.1f} old {got['old'][0]:6.1f} tok/s "
                          f"({prompt[:30]}...)", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    greedy = any(f == "--temp" and flags[i + 1] in ("0", "0.0") for i, f in enumerate(flags[:-1]))
    print(f"{'strategy':10} {'new/old median':>14} {'min':>6} {'max':>6}  outputs differing")
    for strategy, rs in ratios.items():
        print(f"{strategy:10} {statistics.median(rs):>14.3f} {min(rs):>6.3f} {max(rs):>6.3f}  "
              f"{differ[strategy] if greedy else '-'} of {len(rs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
