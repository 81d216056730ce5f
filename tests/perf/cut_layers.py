"""A GGUF cut to its first N layers (not a test: a tool for measurements).

A real model's tokenizer, chat template and first layers, with steps about N/L of
the whole model's: a fast device on a slow one. On the developers' 2-core VM the
SmolLM2 Q2_K cut to 4 of its 30 layers takes 2.2 ms a token, as the whole model
does on an H200 (1.5 ms), so the share of a step the host's work takes there can
be looked at here (docs/results.md, "A GPU"); and at 39 MB it travels to a GPU
machine in one call where the whole model cannot. Its text is no longer the
model's, so acceptance figures measured on it mean little; costs do.

    python tests/perf/cut_layers.py ~/.local/share/specchat/smollm2/smollm2-135m-instruct-Q2_K.gguf /tmp/smol4.gguf 4
"""

from __future__ import annotations

import argparse
import re
import sys

import gguf


def cut(src: str, dst: str, layers: int) -> int:
    """Write `src` with its first `layers` blocks to `dst` (the block count set to match); the tensors kept."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    count = f"{arch}.block_count"
    if count not in reader.fields:
        raise SystemExit(f"{src}: no {count} (not a layered model)")
    if not 0 < layers < reader.fields[count].contents():
        raise SystemExit(f"{src} has {reader.fields[count].contents()} layers: keep between 1 and one fewer")
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, layers if field.name == count else field.contents(), kind, sub_type=sub)
    kept = [t for t in reader.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return len(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("layers", type=int)
    args = ap.parse_args()
    print(f"wrote {args.dst}: {cut(args.src, args.dst, args.layers)} tensors", file=sys.stderr)


if __name__ == "__main__":
    main()
