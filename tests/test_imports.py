"""The architecture's import rules and the files' size, enforced (as harlequin does for its own layers).

- Only the llama.cpp binding (backends/llama.py, its process-wide part, backends/llama_process.py, and its
  extended API for drafters that read hidden states, backends/llama_ext.py) imports llama_cpp: everything else, the RPC client and server in backends/llama_rpc.py included, talks
  to its typed surface.
- The project's modules import each other without cycles (runtime imports, at module level or in a
  function; `if TYPE_CHECKING:` imports may point anywhere): the engine, the strategy registry and `auto`
  once knew each other in a circle.
- backends/ and models/ never import textual or app/: the engine has no UI.
- models/ never imports backends/: model files are handled without llama.cpp (the quantizer is passed in).
- No strategy (backends/strategies/, at any depth, `TYPE_CHECKING` imports included) imports the
  scheduler or the engine (backends.scheduler, backends.engine): a strategy is a step machine that speaks
  the step protocol (backends.steps) and is driven by whoever holds the contexts.
- `specchat --help`, `specchat models ...` and `specchat serve --help` do not load llama.cpp, so they answer at once.
- No source file of the project (app/, backends/, models/, tests/ with tests/perf/) has more than
  MAX_LINES (500) lines, unless its module docstring says why in a sentence that starts with
  "Over 500 lines" (e.g. "Over 500 lines: every case shares the one module-scoped server.").
  Files stay small enough to read top to bottom; a longer one is a decision written down, not an accident.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    """Every module a file imports by its full dotted name (at any depth, TYPE_CHECKING blocks included);
    `from package import name` counts both `package` and `package.name`, since the name may be a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
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


def test_only_the_binding_imports_llama_cpp() -> None:
    assert _offenders(("app", "backends", "models"), ("llama_cpp",),
                      allowed=("backends/llama.py", "backends/llama_process.py", "backends/llama_ext.py")) == []


def test_engine_and_models_have_no_ui() -> None:
    assert _offenders(("backends", "models"), ("textual", "app")) == []


def test_models_do_not_import_the_engine() -> None:
    assert _offenders(("models",), ("backends",)) == []


STRATEGIES_MUST_NOT_IMPORT = ("backends.scheduler", "backends.engine")


def test_strategies_do_not_import_the_scheduler_or_the_engine() -> None:
    strategies = sorted((ROOT / "backends" / "strategies").rglob("*.py"))
    assert len(strategies) > 5 and any(p.parent.name == "auto" for p in strategies), "the scan sees auto/ too"
    bad = []
    for path in strategies:
        hits = sorted(m for m in _imports(path)
                      if any(m == f or m.startswith(f + ".") for f in STRATEGIES_MUST_NOT_IMPORT))
        if hits:
            bad.append(f"{path.relative_to(ROOT)}: {', '.join(hits)}")
    assert bad == [], "strategies speak backends.steps, not the scheduler or the engine: " + "; ".join(bad)


# -- file size -------------------------------------------------------------------------------------------------

MAX_LINES = 500
# A sentence of the module docstring that starts with it (at the docstring's start or after a sentence's end)
# and goes on to give the reason.
_OVER_MARKER = re.compile(r"(?:^|(?<=[.!?:;])\s)Over 500 lines\b\W*\w+")


def _says_why_it_is_long(path: Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return bool(_OVER_MARKER.search(" ".join(doc.split())))


def test_the_long_file_marker_reads_a_sentence() -> None:
    def says(doc: str) -> bool:
        return bool(_OVER_MARKER.search(" ".join(doc.split())))

    assert says("Over 500 lines: one fixture feeds every case.")
    assert says("The server's tests.\n\nOver 500 lines because the cases share one server.")
    assert not says("Over 500 lines")  # no reason given
    assert not says("Not over 500 lines.") and not says("Split when it is over 500 lines long.")


def test_source_files_stay_under_500_lines_unless_they_say_why() -> None:
    files = [p for package in ("app", "backends", "models", "tests") for p in _files(package)]
    assert any(p.parent.name == "perf" for p in files), "the scan sees tests/perf/ too"
    long = []
    for path in files:
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES and not _says_why_it_is_long(path):
            long.append(f"{path.relative_to(ROOT)} ({n} lines)")
    assert long == [], (f"over {MAX_LINES} lines without a docstring sentence starting 'Over 500 lines' that "
                        "says why: " + ", ".join(long))


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["serve", "--help"], ["models", "pairs"],
                                  ["models", "list"], ["bench", "--help"], ["cache", "stats"]])
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


# -- no import cycles ------------------------------------------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules a file imports when it runs (at module level or in a function), not those under
    `if TYPE_CHECKING:`. `from package import name` counts as importing `package.name` when that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = [p for package in ("app", "backends", "models") for p in _files(package)]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _runtime_imports(p, modules) - {_module_name(p)} for p in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a list of its modules (the first closing the loop), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_project_modules_import_each_other_without_cycles() -> None:
    graph = import_graph()
    assert "backends.engine" in graph and "backends.registry" in graph["backends.engine"], "the scan sees the edges"
    cycle = find_cycle(graph)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or [])
