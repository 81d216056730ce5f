"""The architecture's import rules, enforced (as harlequin does for its own layers).

- Only backends/llama.py imports llama_cpp: everything else talks to its typed surface.
- backends/ and models/ never import textual or app/: the engine has no UI.
- models/ never imports backends/: model files are handled without llama.cpp (the quantizer is passed in).
- `specchat --help`, `specchat models ...` and `specchat serve --help` do not load llama.cpp, so they answer at once.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Top-level names of every module a file imports (at any depth, TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _offenders(packages: tuple[str, ...], forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    out = []
    for package in packages:
        for path in _files(package):
            rel = str(path.relative_to(ROOT))
            if rel in allowed:
                continue
            bad = sorted(m for m in _imports(path) if m.split(".")[0] in forbidden)
            if bad:
                out.append(f"{rel}: {', '.join(bad)}")
    return out


def test_the_rules_see_every_package() -> None:
    assert len(_files("app")) > 10 and len(_files("backends")) > 10 and len(_files("models")) > 5
    assert "llama_cpp" in _imports(ROOT / "backends" / "llama.py"), "the scan must find the one real import"


def test_only_backends_llama_imports_llama_cpp() -> None:
    assert _offenders(("app", "backends", "models"), ("llama_cpp",), allowed=("backends/llama.py",)) == []


def test_engine_and_models_have_no_ui() -> None:
    assert _offenders(("backends", "models"), ("textual", "app")) == []


def test_models_do_not_import_the_engine() -> None:
    assert _offenders(("models",), ("backends",)) == []


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["serve", "--help"], ["models", "pairs"],
                                  ["models", "list"], ["bench", "--help"]])
def test_commands_that_run_no_model_do_not_load_llama_cpp(argv: list[str], tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from app.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('LOADED' if 'llama_cpp' in sys.modules else 'CLEAN')\n"
    )
    env = {"SPECCHAT_DATA_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.stdout.strip().splitlines()[-1] == "CLEAN", r.stdout + r.stderr
