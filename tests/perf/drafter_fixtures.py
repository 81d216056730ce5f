"""Write the tiny drafter fixtures to a folder, to run them in llama.cpp's reference tools by hand.

    python tests/perf/drafter_fixtures.py DIR

writes DIR/mtp-target.gguf (a glm4moe target with its own MTP head,
tests/drafter_factory.py: `llama-server -m DIR/mtp-target.gguf --spec-type draft-mtp`)
and DIR/eagle3-target.gguf + DIR/eagle3-draft.gguf (a llama target and an
EAGLE-3 draft for it, tests/eagle3_factory.py: `llama-server -m
DIR/eagle3-target.gguf -md DIR/eagle3-draft.gguf --spec-type draft-eagle3`),
and DIR/dflash-target.gguf + DIR/dflash-draft.gguf (a llama target and a
DFlash block draft for it, tests/dflash_factory.py: `llama-server -m
DIR/dflash-target.gguf -md DIR/dflash-draft.gguf --spec-type draft-dflash`),
and DIR/mtp-chain-hy_v3.gguf + DIR/mtp-chain-step35.gguf (targets with 3 chained
MTP heads, draft k by head k, tests/mtp_chain_factory.py: `llama-server -m
DIR/mtp-chain-step35.gguf --spec-type draft-mtp`),
and DIR/gemma4-target.gguf + DIR/gemma4-assistant.gguf (a Gemma 4 target and
its MTP "assistant" file, which reads the target's KV cells,
tests/gemma4_factory.py: `llama-server -m DIR/gemma4-target.gguf -md
DIR/gemma4-assistant.gguf --spec-type draft-mtp`; docs/gemma4-assistant.md).
docs/eagle3-protocol.md and docs/dflash-protocol.md have the commands and what they print.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the factories import each other as the tests do (conftest.py)

from drafter_factory import write_mtp_target  # noqa: E402
from dflash_factory import write_dflash_pair  # noqa: E402
from eagle3_factory import write_eagle3_pair  # noqa: E402
from gemma4_factory import write_gemma4_pair  # noqa: E402
from mtp_chain_factory import ARCHITECTURES, ChainModel, write_chained_mtp_target  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="folder to write the GGUF files to (made if missing)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the EAGLE-3, DFlash and Gemma 4 pairs' random weights")
    args = ap.parse_args(argv)
    out: Path = args.dir
    out.mkdir(parents=True, exist_ok=True)

    written: list[Path] = []
    target, draft = out / "eagle3-target.gguf", out / "eagle3-draft.gguf"
    write_eagle3_pair(target, draft, seed=args.seed)
    written += [target, draft]

    target, draft = out / "dflash-target.gguf", out / "dflash-draft.gguf"
    write_dflash_pair(target, draft, seed=args.seed)
    written += [target, draft]

    target, draft = out / "gemma4-target.gguf", out / "gemma4-assistant.gguf"
    write_gemma4_pair(target, draft, seed=args.seed)
    written += [target, draft]

    mtp = out / "mtp-target.gguf"
    write_mtp_target(mtp)
    written.append(mtp)

    for arch in ARCHITECTURES:  # the factory's defaults (3 heads), as tests/test_mtp_chain.py writes them
        chained = out / f"mtp-chain-{arch}.gguf"
        write_chained_mtp_target(chained, ChainModel(architecture=arch))
        written.append(chained)

    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
