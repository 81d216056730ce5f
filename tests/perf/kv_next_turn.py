"""Is the next turn slower when the last one's cells go to disk? (not a test: a measurement for
backends/kv_store.py, issue 45's "off the decoding path").

A chat turn over a conversation of about --tokens tokens answers --answer tokens (`ar`); then, at once (a
user who sends the next message the moment the answer ends: the worst case), the next turn (the prompt, the
answer and a new question) answers too. With the store on, between the two the chat session's keep_cells
runs: the snapshot on the decoding thread, the write handed to the store's thread, which runs while the next
turn decodes. Who goes first alternates; medians over repeats: the next turn's time to first token and its
tokens per second, with and without the store, and the snapshot's time.

    python tests/perf/kv_next_turn.py -m smollm2 -md smollm2-draft --tokens 3000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "perf"))

from app.prompt_format import PromptFormat  # noqa: E402
from backends.engine import Engine, EngineConfig  # noqa: E402
from backends.events import Done, Token  # noqa: E402
from backends.kv_store import KvDiskStore, snapshot  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from kv_resume import conversation  # noqa: E402
from models.resolve import resolve_model  # noqa: E402


def answer(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """The answer's tokens, the time to its first token and its tokens per second after that."""
    t0 = time.perf_counter()
    first = None
    for ev in engine.strategy("ar").generate(prompt, GenParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
        if isinstance(ev, Token) and first is None:
            first = time.perf_counter()
        if isinstance(ev, Done):
            end = time.perf_counter()
            assert first is not None
            return list(ev.tokens), first - t0, (len(ev.tokens) - 1) / max(end - first, 1e-9)
    raise RuntimeError("no Done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2")
    ap.add_argument("-md", default="smollm2-draft")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--answer", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(EngineConfig(target=resolve_model(args.m), draft=resolve_model(args.md),
                                 n_ctx=args.tokens + 4 * args.answer + 256, threads=args.t, memory=False))
    store = KvDiskStore(Path(tempfile.mkdtemp(prefix="kv-next-")), engine.kv_key())
    try:
        fmt = PromptFormat(engine)
        prompt = conversation(fmt, args.tokens)
        question = engine.tokenize(" And what follows from that? Explain it in detail.")[1:]
        slot = engine.slots[0]
        results: dict[str, list[tuple[float, float]]] = {"store": [], "none": []}
        snaps = []
        for rep in range(args.repeats):
            for mode in (("store", "none") if rep % 2 == 0 else ("none", "store")):
                slot.reset()
                store.wait()
                first_answer, _, _ = answer(engine, prompt, args.answer)
                if mode == "store":
                    t0 = time.perf_counter()
                    entry = snapshot(slot.target, slot.draft)
                    snaps.append(time.perf_counter() - t0)
                    store.put(entry)  # written on the store's thread, while the next turn decodes
                _, ttft, rate = answer(engine, prompt + first_answer + question, args.answer)
                results[mode].append((ttft, rate))
        store.wait()
        med = statistics.median
        print(f"{args.m} + {args.md}: next turn after a conversation of {len(prompt)} tokens, {args.repeats} "
              f"repeats, -t {args.t}")
        for mode, rows in results.items():
            print(f"  {mode:5}: first token {1000 * med(r[0] for r in rows):.0f} ms, {med(r[1] for r in rows):.1f} "
                  f"tok/s  {[(round(1000 * a), round(b, 1)) for a, b in rows]}")
        print(f"  snapshot on the decoding thread between the turns: {1000 * med(snaps):.0f} ms")
        print(f"  store / none: first token {med(r[0] for r in results['store']) / med(r[0] for r in results['none']):.2f}, "
              f"tok/s {med(r[1] for r in results['store']) / med(r[1] for r in results['none']):.2f}")
    finally:
        store.close()
        engine.close()


if __name__ == "__main__":
    main()
