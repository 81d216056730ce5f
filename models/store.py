"""The local store of known models: alias -> GGUF path (+ where it came from), in data_dir()/models.json.

Written atomically (models.files.write_atomic: temporary file + os.replace),
so a crash never leaves half a file. A file that is corrupt anyway (edited by
hand, a disk error) is not fatal: the store reads as empty with a warning, and
the next write first moves the bad file aside to models.json.corrupt. Why not
refuse to start: the store only holds aliases for files that still exist (in
the Hugging Face cache or the data dir), so nothing is lost that a `models
pull` cannot recreate, while refusing would lock the user out of every command;
and the backup keeps hand edits recoverable.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from models.files import write_atomic
from models.paths import data_dir

STORE_FILE = "models.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class StoredModel:
    alias: str
    path: Path
    repo: str | None = None  # Hub repo it was pulled from
    file: str | None = None  # file name in that repo
    quant: str | None = None
    derived_from: str | None = None  # source path of a `models derive`


class ModelStore:
    """Reads the file on every call: the TUI and a CLI may both write it."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or data_dir() / STORE_FILE
        self.warning: str | None = None  # set when the file on disk was unreadable

    def _load(self) -> dict[str, StoredModel]:
        self.warning = None
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            raw = json.loads(text)
            known = {f.name for f in fields(StoredModel)}
            entries = {}
            for alias, entry in raw["models"].items():
                values = {k: v for k, v in entry.items() if k in known}  # ignore keys from newer versions
                entries[alias] = StoredModel(**{**values, "alias": alias, "path": Path(entry["path"])})
            return entries
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            self.warning = f"{self.path} is corrupt ({type(e).__name__}: {e}); starting with an empty model store"
            return {}

    def all(self) -> dict[str, StoredModel]:
        return self._load()

    def get(self, alias: str) -> StoredModel | None:
        return self._load().get(alias)

    def _save(self, entries: dict[str, StoredModel]) -> None:
        if self.warning is not None and self.path.exists():
            os.replace(self.path, self.path.with_name(self.path.name + ".corrupt"))
            self.warning = None
        data = {
            "version": FORMAT_VERSION,
            "models": {
                alias: {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(m).items() if k != "alias"}
                for alias, m in sorted(entries.items())
            },
        }
        write_atomic(self.path, json.dumps(data, indent=2) + "\n")

    def add(self, model: StoredModel) -> None:
        entries = self._load()
        entries[model.alias] = model
        self._save(entries)

    def remove(self, alias: str) -> bool:
        entries = self._load()
        found = entries.pop(alias, None) is not None
        if found:
            self._save(entries)
        return found
