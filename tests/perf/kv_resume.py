"""Reopening a long conversation: its KV cells read back from disk against decoding its prompt (not a test: a
measurement for backends/kv_store.py).

For a conversation of about --tokens tokens through the model's template,
each repeat times, in turn (who goes first alternates): decoding the prompt
into an empty slot until the first answer token (`ar`, one token), and
reading the entry back from disk (read_entry, restore for target and draft)
and then the first answer token. Also: the snapshot's cost on the decoding
thread, the write's on its own, and bytes per token. Medians over repeats.

    python tests/perf/kv_resume.py -m smollm2 -md smollm2-draft --tokens 3000 --repeats 5
    python tests/perf/kv_resume.py -m demo -md demo-draft --tokens 3000 --repeats 5
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

from app.chat_template import ChatMessage  # noqa: E402
from app.prompt_format import PromptFormat  # noqa: E402
from backends.engine import Engine, EngineConfig  # noqa: E402
from backends.events import Token  # noqa: E402
from backends.kv_store import read_entry, restore, snapshot, write_entry  # noqa: E402
from backends.sampling import GenParams  # noqa: E402
from models.resolve import resolve_model  # noqa: E402


def conversation(fmt: PromptFormat, tokens: int) -> list[int]:
    """Turns of a made-up chat until the prompt holds about `tokens` tokens."""
    messages: list[ChatMessage] = []
    i = 0
    while True:
        messages += [ChatMessage("user", f"Question {i}: what do you know about topic number {i}? Be thorough."),
                     ChatMessage("assistant", " ".join(f"Topic {i} has property {j}, which matters because of "
                                                       f"reason {j * 7 % 11}." for j in range(12)))]
        out = fmt.tokens([*messages, ChatMessage("user", "Summarize everything.")])
        if len(out) >= tokens:
            return out
        i += 1


def first_token(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    for ev in engine.strategy("ar").generate(prompt, GenParams(max_tokens=1)):
        if isinstance(ev, Token):
            return time.perf_counter() - t0
    raise RuntimeError("no token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2")
    ap.add_argument("-md", default="smollm2-draft")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(EngineConfig(target=resolve_model(args.m), draft=resolve_model(args.md),
                                 n_ctx=args.tokens + 512, threads=args.t))
    try:
        fmt = PromptFormat(engine)
        prompt = conversation(fmt, args.tokens)
        slot = engine.slots[0]
        path = Path(tempfile.mkdtemp(prefix="kv-resume-")) / "conversation.kv"
        decode, restored, snap, write = [], [], [], []
        for rep in range(args.repeats):
            for kind in (("decode", "restore") if rep % 2 == 0 else ("restore", "decode")):
                slot.reset()
                if kind == "decode":
                    decode.append(first_token(engine, prompt))
                    slot.target.sync(prompt, logits=False)
                    slot.draft.sync(prompt, logits=False)
                    t0 = time.perf_counter()
                    entry = snapshot(slot.target, slot.draft)
                    t1 = time.perf_counter()
                    write_entry(path, engine.kv_key(), entry)
                    snap.append(t1 - t0)
                    write.append(time.perf_counter() - t1)
                elif path.exists():
                    t0 = time.perf_counter()
                    restore(read_entry(path, engine.kv_key()), slot.target, slot.draft, prompt)
                    first_token(engine, prompt)
                    restored.append(time.perf_counter() - t0)
        size = path.stat().st_size
        med = statistics.median
        print(f"{args.m} + {args.md}: a conversation of {len(prompt)} tokens, {args.repeats} repeats, -t {args.t}")
        print(f"  first token after decoding the prompt: {med(decode):.3f} s  {['%.3f' % x for x in decode]}")
        print(f"  first token after restoring from disk: {med(restored):.3f} s  {['%.3f' % x for x in restored]}")
        print(f"  restore / decode: {med(restored) / med(decode):.3f}")
        print(f"  snapshot on the decoding thread: {1000 * med(snap):.0f} ms; write on its own thread: "
              f"{1000 * med(write):.0f} ms; {size / 1e6:.1f} MB on disk, {size / len(prompt) / 1000:.1f} kB a token "
              "(target and draft)")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
