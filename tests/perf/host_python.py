"""The host's pure-Python time a token, with llama.cpp's one-row decodes stubbed out (not a test: a probe).

`held_back_host.py` times the host's work around real decodes, where the caches the decode leaves cold make
each microsecond of Python cost several; this leaves only the Python: after one real one-row decode, every
one-row decode returns at once and its logits are that decode's. Three drivers on the tests' tiny GGUF, in
turns: `ar` alone (backends.steps.run_solo), `ar` through a scheduler of one (backends.scheduler.Alone, what
`auto` alone runs through), and `auto` held back by the realised check from the first step (its probes off:
they decode several rows, which a stub cannot answer).

    python tests/perf/host_python.py --tokens 3000 --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2]),
                str(Path(__file__).resolve().parent)]

from auto_helpers import recorded  # noqa: E402
from gguf_factory import write_llama_gguf  # noqa: E402
from held_back_host import OPTIONS, losing, rows_look_free  # noqa: E402
from test_lossless import _copying_prompt  # noqa: E402

from backends import llama, realised  # noqa: E402
from backends.engine import Engine, EngineConfig  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from backends.scheduler import Alone, Scheduler  # noqa: E402
from backends.strategies.auto.state import AutoState  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=6, help="runs of each, in turns (who goes first alternates)")
    args = ap.parse_args()
    realised.STALE = 1 << 30  # no probes
    path = Path(tempfile.mkdtemp(prefix="host-python-")) / "target.gguf"
    write_llama_gguf(path)
    engine = Engine(EngineConfig(target=path, n_ctx=args.tokens + 256, threads=1, n_seq_max=8, cost_cache=Path("")))
    rows_look_free(engine)
    options = OPTIONS
    params = GenParams(max_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True)
    prompt = _copying_prompt(engine)  # (it decodes: before the stub)
    decode, logits = llama.LlamaContext.decode, llama.LlamaContext.logits
    saved: list = []
    stubbed = [False]

    def stub_decode(self, batch):  # type: ignore[no-untyped-def]
        stubbed[0] = len(batch) == 1 and bool(saved)
        if not stubbed[0]:
            decode(self, batch)
            if len(batch) == 1:
                saved[:] = [logits(self, 0).copy()]

    llama.LlamaContext.decode = stub_decode  # type: ignore[method-assign]
    llama.LlamaContext.logits = lambda self, row: saved[0] if stubbed[0] else logits(self, row)  # type: ignore
    drivers = {
        "ar": lambda: engine.strategy("ar", options),
        "ar, a scheduler of one": lambda: Alone(engine.strategy("ar", options),
                                                lambda: Scheduler(engine.target_lane, engine.learnt,
                                                                  engine.slots[0].load)),
        "auto held back": lambda: engine.strategy("auto", options),
    }
    times: dict[str, list[float]] = {name: [] for name in drivers}
    try:
        for rep in range(args.repeats):
            for name in (list(drivers) if rep % 2 == 0 else list(reversed(drivers))):
                engine.auto_states = {mode: AutoState(learn_timing=True) for mode in ("greedy", "sampled")}
                recorded(engine, losing())
                t0 = time.perf_counter()
                done = list(drivers[name]().generate(prompt, params))[-1]
                assert done.reason == "length", done
                times[name].append((time.perf_counter() - t0) / args.tokens * 1e6)
    finally:
        engine.close()
    for name, values in times.items():
        print(f"{name:24} {statistics.median(values):6.1f} µs a token (median of {len(values)})")


if __name__ == "__main__":
    main()
