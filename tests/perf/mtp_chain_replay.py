"""Chained MTP heads: where specchat's drafted/accepted counts part from llama-server's (not a test).

tests/perf/drafters_vs_llama_server.py finds the same greedy tokens on the
chained-head fixtures (mtp-chain-hy_v3.gguf, mtp-chain-step35.gguf) but other
accepted/drafted counts. This prints, prompt by prompt, for the same raw
prompts at temperature 0 (K 3, p_min 0, K fixed, one slot):

    llama-server's loop     tests/llama_server_mtp.py replaying common/speculative.cpp's draft-mtp
                            (chain_heads) and the server's slot loop on this build, in process
    the same, first drafted that loop with one change: the prompt less its last token is decoded
                            and the first step drafts for the first output token
    specchat sps            Engine, `sps` with SpsConfig(draft_max=K, p_min=0, adaptive=False)

Where the second and third rows are equal and the first matches llama-server's
own counts (drafters_vs_llama_server.py -v prints them per prompt), the whole
difference is that specchat drafts for the first token (docs/mtp-chain.md).

    .venv/bin/python tests/perf/mtp_chain_replay.py [--dir DIR] [-k 3] [-n 32] [-t 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from drafters_vs_llama_server import PROMPTS  # noqa: E402
from mtp_chain_factory import ARCHITECTURES, ChainModel, write_chained_mtp_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="folder with mtp-chain-ARCH.gguf (default: write anew)")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()

    from backends.config import StrategyOptions
    from backends.engine import Engine, EngineConfig
    from backends.sampling import GenParams
    from backends.strategies.sps import SpsConfig
    from llama_server_mtp import ChainedMtpServer

    folder = args.dir or Path(tempfile.mkdtemp(prefix="mtp-chain-"))
    options = StrategyOptions(sps=SpsConfig(draft_max=args.k, p_min=0.0, adaptive=False))
    print(f"| file | schedule | {' | '.join(f'prompt {i + 1}' for i in range(len(PROMPTS)))} | all |")
    print("|---|---|" + "---:|" * (len(PROMPTS) + 1))
    for arch in ARCHITECTURES:
        path = folder / f"mtp-chain-{arch}.gguf"
        if not path.exists():  # as drafter_fixtures.py writes it
            write_chained_mtp_target(path, ChainModel(architecture=arch))
        server = ChainedMtpServer(path, k=args.k, threads=args.t)
        engine = Engine(EngineConfig(target=path, n_ctx=512, threads=args.t, cost_cache=Path(""), memory=False))
        try:
            prompts = [engine.tokenize(p) for p in PROMPTS]
            rows = {"llama-server's loop": [server.generate(p, args.n) for p in prompts],
                    "the same, first drafted": [server.generate(p, args.n, draft_first=True) for p in prompts]}
            ours = []
            for p in prompts:
                done = None
                for event in engine.strategy("sps", options).generate(p, GenParams(max_tokens=args.n,
                                                                                   temperature=0.0)):
                    done = event
                ours.append((list(done.tokens), done.stats.drafted, done.stats.accepted))
            tokens = [g.tokens for g in rows["llama-server's loop"]]
            same = all(t == o[0] for t, o in zip(tokens, ours)) and \
                all(g.tokens == t for g, t in zip(rows["the same, first drafted"], tokens))
            cells = {name: [(g.accepted, g.drafted) for g in gens] for name, gens in rows.items()}
            cells["specchat sps"] = [(a, d) for _, d, a in ours]
            for name, counts in cells.items():
                total = f"{sum(a for a, _ in counts)}/{sum(d for _, d in counts)}"
                print(f"| {path.name} | {name} | " + " | ".join(f"{a}/{d}" for a, d in counts) + f" | {total} |")
            print(f"{path.name}: greedy tokens {'the same' if same else 'DIFFER'} in all three", file=sys.stderr)
        finally:
            engine.close()
            server.close()
    print(f"{len(PROMPTS)} prompts, {args.n} tokens, K {args.k}, accepted/drafted; files in {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
