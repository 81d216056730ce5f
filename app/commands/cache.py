"""`specchat cache stats` and `specchat cache clear`: the speculation memory and the KV cells kept on disk,
seen and emptied by their owner.

The chat app keeps each conversation's KV cells in the data dir's `kv/`
folder (or $SPECCHAT_KV_DIR; backends.kv_store); `stats` says how many and
how big, `clear` deletes them with the memory.

The memory (backends.memory) keeps the ends of earlier prompts and their
outputs, one file per vocabulary, in the data dir's `suffix/` folder (or
$SPECCHAT_MEMORY_DIR). `stats` reads the files without loading a model:
documents, tokens, size on disk, and what the memory's proposals did (hit
rate: lookups that found a continuation; acceptance: proposed tokens the
target accepted). `clear` deletes them (all, or the file named).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.errors import UserError


def add_cache_parser(sub: argparse._SubParsersAction, parser_class: type) -> None:
    cache = sub.add_parser("cache", help="the speculation memory and the KV cells on disk: stats, clear",
                           description="The speculation memory of earlier outputs (one file per vocabulary) and "
                                       "the conversations' KV cells the chat app keeps on disk.")
    verbs = cache.add_subparsers(dest="cache_command", parser_class=parser_class, required=True)
    stats = verbs.add_parser("stats", help="what the memory holds and how well it proposes")
    stats.add_argument("--json", action="store_true", help="one JSON object per file")
    clear = verbs.add_parser("clear", help="delete the memory (every vocabulary's, or one file) and the KV cells")
    clear.add_argument("file", nargs="?", help="one memory file (default: all of them, and the KV cells)")


def _folder() -> Path | None:
    from backends.memory_file import memory_dir

    return memory_dir(None)


def _kv(args: argparse.Namespace) -> None:
    """The KV cells on disk: stats, or cleared (with every memory file, not with one)."""
    from backends.kv_store import describe_store, kv_dir, leftovers

    folder = kv_dir()
    if folder is None or (args.cache_command == "clear" and args.file):
        return
    if args.cache_command == "stats":
        info = describe_store(folder)
        if args.json:
            print(json.dumps({"kv": info}))
        else:
            print(f"KV cells on disk: {info['entries']} conversations, {info['bytes'] / 1e6:.1f} MB in {folder}"
                  + (f" ({info['set_aside']} files set aside)" if info["set_aside"] else ""))
        return
    files = [*folder.glob("*.kv"), *leftovers(folder)] if folder.is_dir() else []
    for path in files:
        path.unlink(missing_ok=True)
    print(f"cleared {len(files)} KV file{'s' * (len(files) != 1)} in {folder}")


def run_cache(args: argparse.Namespace) -> int:
    from backends.memory_file import counters_path, describe_file, memory_files

    _kv(args)
    folder = _folder()
    if folder is None:  # a documented setting, not an error: nothing of it to show or clear
        if args.cache_command == "clear" and args.file:
            raise UserError(f"{args.file}: the speculation memory is off ($SPECCHAT_MEMORY_DIR is empty)")
        if getattr(args, "json", False):
            print(json.dumps({"memory": None}))
        else:
            print("the speculation memory is off ($SPECCHAT_MEMORY_DIR or $SPECCHAT_SUFFIX_CACHE is empty)")
        return 0
    files = memory_files(folder)
    if args.cache_command == "stats":
        if not files:
            print(json.dumps({"memory": {"folder": str(folder), "files": 0}}) if args.json
                  else f"the speculation memory is empty ({folder})")
            return 0
        for path in files:
            info = describe_file(path)
            if args.json:
                print(json.dumps(info))
            elif "error" in info:
                print(f"{path.name}: unreadable: {info['error']}")
            else:
                hit = f"{100 * info['hit_rate']:.0f}%" if info["hit_rate"] is not None else "-"
                acc = f"{100 * info['acceptance']:.0f}%" if info["acceptance"] is not None else "-"
                print(f"{path.name}: {info['documents']} texts, {info['tokens']:,} tokens, "
                      f"{info['file_bytes'] / 1024:.0f} KiB; lookups {info.get('lookups', 0)}, hit rate {hit}, "
                      f"proposed tokens accepted {acc}")
        return 0
    targets = files
    if args.file:  # one of the memory's own files, by path or by name: never any other file
        ours = {path.resolve(): path for path in files}
        chosen = ours.get(Path(args.file).resolve()) or ours.get((folder / args.file).resolve())
        if chosen is None:
            raise UserError(f"{args.file}: not a memory file in {folder} (see specchat cache stats)")
        targets = [chosen]
    for path in targets:
        path.unlink()
        counters_path(path).unlink(missing_ok=True)
    print(f"cleared {len(targets)} memory file{'s' * (len(targets) != 1)} in {folder}")
    return 0
