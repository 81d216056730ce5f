"""What a drafter that comes with the model costs against a target step, and what `auto` does with it (issue
44's "priced, not assumed").

    python tests/perf/mtp_cost.py DIR [--drafters mtp,eagle3,dflash] [--repeats 3] [-n 96]

Writes mid-size targets (8 layers of 512, so a decode costs milliseconds, not the tiny tests' tens of
microseconds) with each kind of drafter, two of each: `agreeing` (its drafts are often accepted) and `random`
(random weights: almost never accepted, as with any real head of another model). MTP: glm4moe targets with
their own head (tests/drafter_factory.py); EAGLE-3: a llama target and a one-layer `eagle3` draft reading three
of its layers (tests/eagle3_factory.py); DFlash: the same target shape and a `dflash` block draft
(tests/dflash_factory.py). For each, `specchat bench -s ar,sps,auto` on the builtin prompts, greedy,
interleaved repeats: the device cost it measures (one draft token in target tokens) and each strategy's speed
against ar. Nothing else may run meanwhile (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from dflash_factory import DFlashPair, write_dflash_pair  # noqa: E402
from drafter_factory import MtpModel, write_mtp_target  # noqa: E402
from eagle3_factory import Eagle3Pair, write_eagle3_pair  # noqa: E402

SIZE = dict(n_embd=512, n_layer=8, n_head=8, n_ff=1536, n_expert=4, n_expert_used=2, n_ff_exp=384)
PAIR = dict(n_embd=512, n_layer=8, n_head=8, n_ff=1536, target_layers=(2, 4, 7))


def write(kind: str, name: str, folder: Path) -> list[str]:
    """The files of one kind and name (written once); the bench's model flags for them."""
    target, draft = folder / f"{kind}-{name}.gguf", folder / f"{kind}-{name}-draft.gguf"
    agreeing = name == "agreeing"
    if kind == "mtp":
        if not target.exists():
            write_mtp_target(target, MtpModel(residual=0.1, head_noise=0.1, **SIZE) if agreeing else
                             MtpModel(residual=1.0, head_noise=1.0, seed=3, **SIZE))
        return ["-m", str(target)]
    if not (target.exists() and draft.exists()):
        if kind == "eagle3":
            write_eagle3_pair(target, draft, seed=0 if agreeing else 3,
                              model=Eagle3Pair(**PAIR) if agreeing else Eagle3Pair(residual=1.0, head_noise=1.0, **PAIR))
        elif kind == "dflash":
            write_dflash_pair(target, draft, seed=0 if agreeing else 3,
                              model=DFlashPair(**PAIR) if agreeing else DFlashPair(residual=1.0, noise=1.0, **PAIR))
        else:
            raise SystemExit(f"unknown drafter {kind!r}: mtp, eagle3 or dflash")
    return ["-m", str(target), "-md", str(draft)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--drafters", default="mtp,eagle3,dflash")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    for kind, name in ((k, n) for k in args.drafters.split(",") for n in ("agreeing", "random")):
        models = write(kind, name, args.dir)
        name = f"{kind} {name}"
        out = args.dir / f"bench-{name.replace(' ', '-')}"
        cmd = [sys.executable, "-m", "app", "bench", *models, "-s", "ar,sps,auto", "--temp", "0",
               "-n", str(args.n), "--repeats", str(args.repeats), "-t", str(args.threads), "--raw",
               "--out", str(out)]
        print("$ " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        report = json.loads((out / "bench.json").read_text())
        print(f"{name}: one draft token = {report['draft_cost']:.3f} target tokens")
        for row in report["results"]:
            print(f"  {row['label']:24} {row['tokens_per_second']:7.1f} tok/s  {row['speedup']:.2f}x ar  "
                  f"acceptance {row['acceptance_rate']:.2f}  greedy = ar: {row['greedy_matches_ar']}  "
                  f"by source {row['tokens_by_source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
