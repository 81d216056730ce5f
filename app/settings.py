"""The chat app's settings, kept in a JSON file in platformdirs' per-user config dir.

`SPECCHAT_CONFIG_DIR` overrides the folder (tests, portable installs). The
file is written atomically; a file that cannot be read (hand-edited, from an
older version) falls back to the defaults with a warning instead of stopping
the app.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Mapping, TypeVar

import platformdirs

from backends.config import MEMORY_TOKENS, StrategyOptions
from backends.kv_store import DISK_BYTES
from backends.registry import DEFAULT_STRATEGY, STRATEGIES
from backends.sampling import GenParams
from backends.settings_schema import Knob, json_value, setting_of, strategy_flags
from models.files import write_atomic

SETTINGS_FILE = "settings.json"
# Version 2: chat samples with llama.cpp's defaults and runs `auto` (version 1 files carry greedy and sps).
SETTINGS_VERSION = 3
# Chat turns are longer than a one-shot completion's default.
CHAT_MAX_TOKENS = 512
# llama.cpp's sampling defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05): small models loop under greedy.
CHAT_TEMPERATURE = 0.8
# Sequence ids every context is made with, so the user can switch to lookahead or
# tree mid-chat without reloading (kv_unified: the ids share one cache, no extra memory).
CHAT_N_SEQ_MAX = 64

T = TypeVar("T")
# What gpt-oss's template reads as `reasoning_effort` (llama-server passes the field's value through).
REASONING_EFFORTS = ("low", "medium", "high")


@dataclass(frozen=True)
class Settings:
    target: str | None = None
    draft: str | None = None
    strategy: str = DEFAULT_STRATEGY
    params: GenParams = field(default_factory=lambda: GenParams(max_tokens=CHAT_MAX_TOKENS,
                                                                temperature=CHAT_TEMPERATURE))
    options: StrategyOptions = field(default_factory=StrategyOptions)
    system_prompt: str = ""
    speculation_view: bool = True
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int | None = None
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int = 0
    rpc: tuple[str, ...] = ()  # llama.cpp RPC servers for the target (HOST:PORT each)
    memory: bool = True  # the speculation memory (backends.memory): consulted and updated
    mtp: bool = True  # a target's own MTP head drafts when no draft model is given (backends.mtp)
    memory_size: int = MEMORY_TOKENS  # its bound, in tokens
    # A thinking model thinks before it answers (its template's enable_thinking); its budget is
    # params.reasoning_budget (backends.reasoning).
    thinking: bool = True
    # How hard a template that reads `reasoning_effort` (gpt-oss's: low, medium, high) thinks; None: its default.
    reasoning_effort: str | None = None
    # The KV cells kept on disk (backends.kv_store): the chat app's conversations, the server's prompt cache;
    # its bound in bytes (0: off).
    kv_disk: int = DISK_BYTES

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.n_ctx < 16:
            raise ValueError("the context size must be at least 16 tokens")
        if self.n_batch < 1:
            raise ValueError("the batch size (-b) must be at least 1")
        if self.memory_size < 1000:
            raise ValueError("--memory-size must be at least 1000 tokens")
        if self.kv_disk < 0:
            raise ValueError("--kv-cache-disk must be 0 (off) or more")
        if self.reasoning_effort not in (None, *REASONING_EFFORTS):
            raise ValueError(f"--reasoning-effort takes {', '.join(REASONING_EFFORTS)}; got {self.reasoning_effort!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError("the thread count (-t) must be at least 1")


def get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def with_paths(obj: Any, values: Mapping[str, Any]) -> Any:
    """A copy of `obj` with the field at each path replaced.

    Each dataclass on the way is rebuilt once with all its new values, so its
    checks across fields (e.g. lookup's n-gram min <= max) see the final ones.
    """
    leaves: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            leaves[head] = value
    changes = {head: with_paths(getattr(obj, head), sub) for head, sub in nested.items()}
    return replace(obj, **changes, **leaves) if changes or leaves else obj


def with_path(obj: Any, path: str, value: Any) -> Any:
    return with_paths(obj, {path: value})


# argparse dest -> the Settings paths it sets, for the flags that are not a strategy's; one table for `run`,
# `bench` and `chat`. The strategies' flags (and their fan-out: --draft-max is K for sps, lookup and auto)
# come from their fields' declarations in backends.config: flag_paths() has both.
FLAG_PATHS: dict[str, tuple[str, ...]] = {
    "model": ("target",),
    "model_draft": ("draft",),
    "strategy": ("strategy",),
    "system": ("system_prompt",),
    "max_tokens": ("params.max_tokens",),
    "temp": ("params.temperature",),
    "top_k": ("params.top_k",),
    "top_p": ("params.top_p",),
    "min_p": ("params.min_p",),
    "seed": ("params.seed",),
    "stop": ("params.stop",),
    "ignore_eos": ("params.ignore_eos",),
    "thinking": ("thinking",),
    "reasoning_effort": ("reasoning_effort",),
    "reasoning_budget": ("params.reasoning_budget",),
    "kv_cache_disk": ("kv_disk",),
    "memory": ("memory",),
    "mtp": ("mtp",),
    "memory_size": ("memory_size",),
    "ctx_size": ("n_ctx",),
    "batch_size": ("n_batch",),
    "threads": ("threads",),
    "gpu_layers": ("n_gpu_layers",),
    "gpu_layers_draft": ("n_gpu_layers_draft",),
    "rpc": ("rpc",),
}
GENERATION = ("params.", "options.")
RANDOM_SEED = -1  # --seed -1, llama.cpp's LLAMA_DEFAULT_SEED: a new random seed each time


def flag_paths(options: StrategyOptions | None = None) -> dict[str, tuple[str, ...]]:
    """Every flag's argparse dest -> the Settings paths it sets: FLAG_PATHS and the strategies' flags."""
    strategy = {flag.dest: tuple(f"options.{k.path}" for k in knobs)
                for flag, knobs in strategy_flags(options or StrategyOptions())}
    return {**FLAG_PATHS, **strategy}


def apply_flags(settings: Settings, args: argparse.Namespace, only: tuple[str, ...] = ("",)) -> Settings:
    """`settings` with the flags in `args` that are not None applied, to the paths starting with `only`.
    A switch (--no-adaptive) sets its fields' declared value when given."""
    switches = {flag.dest: flag.sets for flag, _ in strategy_flags(settings.options) if flag.sets is not None}
    values: dict[str, Any] = {}
    for dest, paths in flag_paths(settings.options).items():
        value = getattr(args, dest, None)
        if value is None or (dest in switches and not value):
            continue
        if dest in switches:
            value = switches[dest]
        if dest == "seed" and value == RANDOM_SEED:
            value = None  # a random seed, overriding a saved one
        for path in paths:
            if path.startswith(only):
                values[path] = tuple(value) if dest == "stop" else value
    return with_paths(settings, values)


def config_dir() -> Path:
    override = os.environ.get("SPECCHAT_CONFIG_DIR")
    return Path(override).expanduser() if override else Path(platformdirs.user_config_dir("specchat", appauthor=False))


def _from_dict(default: T, data: Any) -> T:
    """A (nested) settings dataclass rebuilt from JSON over `default`, each value checked against the default's
    type (a strategy's field: against its declaration)."""
    if not isinstance(data, dict):
        raise ValueError(f"expected an object for {type(default).__name__}")
    values = {}
    for f in fields(default):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        current, value = getattr(default, f.name), data[f.name]
        declared = setting_of(f)
        if declared is not None:  # a strategy's field: its kind and words (tree nodes 'auto') as declared
            try:
                value = json_value(Knob(f.name, current, declared), value)
            except ValueError as e:
                raise ValueError(f"{f.name}: expected {e}, got {value!r}") from None
        elif is_dataclass(current):
            value = _from_dict(current, value)
        elif isinstance(current, tuple):
            if isinstance(value, str):  # one endpoint or stop string written bare, not a list of characters
                value = (value,)
            elif not isinstance(value, list):
                raise ValueError(f"{f.name}: expected a list, got {value!r}")
            value = tuple(value)
        elif current is not None and value is not None and not isinstance(value, type(current)):
            if not (isinstance(current, float) and isinstance(value, int)):  # an int may stand for a float
                raise ValueError(f"{f.name}: expected {type(current).__name__}, got {value!r}")
        values[f.name] = value
    return replace(default, **values)  # type: ignore[type-var]


def _migrate(data: dict[str, Any]) -> dict[str, Any]:
    """A file of an older version, in today's terms.

    Version 1 (no "version" key) saved every field, so its greedy temperature
    and its `sps` strategy were the old defaults rather than choices: they
    become today's (llama.cpp's sampling, `auto`). Versions 1 and 2 called the
    speculation memory `suffix_cache` (and its bound `suffix_cache_size`).
    """
    data = dict(data)
    version = data.pop("version", 1)
    if version < 2:
        if isinstance(data.get("params"), dict) and data["params"].get("temperature") == 0.0:
            data["params"] = {**data["params"], "temperature": CHAT_TEMPERATURE}
        if data.get("strategy") == "sps":
            data["strategy"] = DEFAULT_STRATEGY
    if version < 3:
        data = _renamed(data, {"suffix_cache": "memory", "suffix_cache_size": "memory_size"})
        if isinstance(data.get("options"), dict):
            data["options"] = _renamed(data["options"], {"suffix_cache": "memory"})
    return data


def _renamed(data: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {names.get(key, key): value for key, value in data.items()}


def load_settings(path: Path | None = None, defaults: Settings | None = None) -> tuple[Settings, str | None]:
    """The saved settings over `defaults` (Settings()) and, if the file was unusable, a warning saying so."""
    path = path or config_dir() / SETTINGS_FILE
    defaults = defaults or Settings()
    if not path.exists():
        return defaults, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        return _from_dict(defaults, _migrate(data)), None
    except (OSError, ValueError, TypeError) as e:
        return defaults, f"ignored unreadable settings file {path}: {e}"


def save_settings(settings: Settings, path: Path | None = None) -> None:
    data = {"version": SETTINGS_VERSION, **asdict(settings)}
    write_atomic(path or config_dir() / SETTINGS_FILE, json.dumps(data, indent=2) + "\n")
