"""Atomic file writes: a crash or a full disk never leaves a truncated file.

The new content goes to a temporary file in the same folder (same file
system, so the rename is atomic on POSIX and Windows), is flushed and fsynced,
then `os.replace`d over the old one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence


def write_atomic(path: Path, data: str | bytes | Sequence[bytes]) -> None:
    """`path` holds `data` (text as UTF-8; or byte strings one after another, written as they are: no copy
    joins them, which for large ones would hold Python's lock while a decoding thread waits), or what it held
    before: written beside it (readable by its owner only), synced, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # (a short prefix: a name near the file system's 255 bytes leaves no room for a longer temporary one)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:40]}.", suffix=".tmp", dir=path.parent)
    chunks = [data.encode("utf-8")] if isinstance(data, str) else [data] if isinstance(data, bytes) else data
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[f.write(view):]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
