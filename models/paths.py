"""Where specchat keeps its files: platformdirs' per-user data dir.

`SPECCHAT_DATA_DIR` overrides it (tests, CI, portable installs).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    override = os.environ.get("SPECCHAT_DATA_DIR")
    path = Path(override).expanduser() if override else Path(platformdirs.user_data_dir("specchat", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path
