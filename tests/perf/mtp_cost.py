"""What an MTP head costs against a target step, and what `auto` does with it (issue 44's "priced, not assumed").

    python tests/perf/mtp_cost.py DIR [--repeats 3] [-n 96]

Writes two mid-size glm4moe targets with their own MTP head (tests/drafter_factory.py; 8 trunk layers of
512, about 40M parameters, so a decode costs milliseconds, not the tiny tests' tens of microseconds):
`agreeing` (the head often agrees with the target) and `random` (random weights: its drafts are almost
never accepted, as with any real head of another model). For each, `specchat bench -s ar,sps,auto` on the
builtin prompts, greedy, interleaved repeats: the device cost it measures (one MTP draft token in target
tokens) and each strategy's speed against ar. Nothing else may run meanwhile (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from drafter_factory import MtpModel, write_mtp_target  # noqa: E402

SIZE = dict(n_embd=512, n_layer=8, n_head=8, n_ff=1536, n_expert=4, n_expert_used=2, n_ff_exp=384)
FILES = {"agreeing": MtpModel(residual=0.1, head_noise=0.1, **SIZE),
         "random": MtpModel(residual=1.0, head_noise=1.0, seed=3, **SIZE)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, model in FILES.items():
        path = args.dir / f"mtp-{name}.gguf"
        if not path.exists():
            write_mtp_target(path, model)
        out = args.dir / f"bench-{name}"
        cmd = [sys.executable, "-m", "app", "bench", "-m", str(path), "-s", "ar,sps,auto", "--temp", "0",
               "-n", str(args.n), "--repeats", str(args.repeats), "-t", str(args.threads), "--raw",
               "--out", str(out)]
        print("$ " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        report = json.loads((out / "bench.json").read_text())
        print(f"{name}: one MTP draft token = {report['draft_cost']:.3f} target tokens")
        for row in report["results"]:
            print(f"  {row['label']:24} {row['tokens_per_second']:7.1f} tok/s  {row['speedup']:.2f}x ar  "
                  f"acceptance {row['acceptance_rate']:.2f}  greedy = ar: {row['greedy_matches_ar']}  "
                  f"by source {row['tokens_by_source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
