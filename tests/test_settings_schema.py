"""Each strategy setting is declared once, beside its field in backends.config, and shows up on every surface.

The surfaces: the command line (app.cli), the settings file (app.settings), the chat app's settings panel
(F4, app.tui.settings_screen) and the server's per-request `speculative` object (app.serve.request). The walk
below checks every declared field on each surface its declaration names (a flag: the command line; a label:
the F4 panel; every field: the file and the server), with a value other than its default. Then a field
declared in one place, by patching a declaration or by a new field on a subclass, must appear on all four;
and the checks themselves must notice a surface that lacks a field.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import pytest
from textual.app import App

from app.cli import add_strategy_flags, build_parser, settings_from_args
from app.serve.request import ApiError, speculation, speculative_keys
from app.settings import Settings, apply_flags, flag_paths, get_path, load_settings, save_settings, with_path
from app.tui.settings_screen import SettingsScreen, parse_value, screen_fields, strategy_rows
from backends.config import AT_LEAST_1, SpsConfig, StrategyOptions, SuffixConfig
from backends.registry import STRATEGIES
from backends.settings_schema import SCHEMA_KEY, Flag, Knob, Range, Setting, knobs, setting, strategy_flags

Parse = Callable[[list[str]], Settings]

# Today's surfaces, spelled out: the derivation must keep them (flag spellings and order, F4 rows and labels).
CLI_FLAGS = ["--draft-max", "--draft-p-min", "--no-adaptive", "-W", "--lookahead-window", "-N", "--lookahead-ngram",
             "-G", "--lookahead-guesses", "--lookahead-seed-prompt", "--lookup-ngram-max", "--lookup-ngram-min",
             "--tree-depth", "--tree-top-k", "--tree-nodes", "--tree-shape", "--draft-p-split"]
F4_ROWS = [("options.sps.draft_max", "sps: K"), ("options.sps.p_min", "sps: p_min"),
           ("options.sps.adaptive", "sps: adaptive K"), ("options.lookahead.window", "lookahead: W"),
           ("options.lookahead.ngram", "lookahead: N"), ("options.lookahead.guesses", "lookahead: G"),
           ("options.lookup.draft_max", "lookup: K"), ("options.lookup.ngram_max", "lookup: n-gram max"),
           ("options.tree.depth", "tree: depth"), ("options.tree.top_k", "tree: top-k"),
           ("options.tree.nodes", "tree: nodes M"), ("options.tree.shape", "tree: shape"),
           ("options.tree.p_split", "tree: p_split")]
FAN_OUT = {"draft_max": ("options.sps.draft_max", "options.lookup.draft_max", "options.auto.draft_max"),
           "draft_p_min": ("options.sps.p_min", "options.tree.p_min")}


def sample(knob: Knob) -> tuple[Any, str]:
    """A value other than the field's default that its declaration allows, and its text."""
    s = knob.setting
    if s.flag is not None and s.flag.sets is not None:
        return s.flag.sets, ""
    if knob.kind is bool:
        return not knob.default, ""
    if s.choices:
        value = next(c for c in s.choices if c != knob.default)
    elif s.words and knob.default not in s.words:
        value = s.words[0]  # a number field's word ('auto'): read by the same code as a number
    elif knob.kind is int:
        value = knob.default + 1
    else:
        value = next(v for v in (0.25, 0.05, 0.15, 3.0) if v != knob.default and (s.range is None or s.range.holds(v)))
    return value, str(value)


def real_cli(tail: list[str]) -> Settings:
    return settings_from_args(build_parser().parse_args(["run", "hi", "-m", "x.gguf", *tail]))


def real_chat_flags(tail: list[str]) -> Settings:
    """`specchat chat`: only the flags given override the saved settings."""
    return apply_flags(Settings(strategy="lookup"), build_parser().parse_args(["chat", *tail]))


def cli_for(defaults: Settings) -> Parse:
    """The strategies' flags of `defaults.options` on a bare parser, applied over `defaults`."""
    def parse(tail: list[str]) -> Settings:
        parser = argparse.ArgumentParser()
        add_strategy_flags(parser, defaults.options)
        return apply_flags(defaults, parser.parse_args(tail))

    return parse


# -- one check per surface ----------------------------------------------------------------------------------------


def check_cli(knob: Knob, parse: Parse, options: StrategyOptions) -> None:
    flag = knob.setting.flag
    assert flag is not None
    value, text = sample(knob)
    settings = parse([flag.names[-1]] + ([text] if flag.sets is None else []))
    fan_out = dict(strategy_flags(options))[flag]
    assert knob in fan_out
    for k in fan_out:  # the flag sets every field that names it
        assert get_path(settings, f"options.{k.path}") == value, (flag.names, k.path)
    assert flag_paths(options)[flag.dest] == tuple(f"options.{k.path}" for k in fan_out)


def check_file(knob: Knob, defaults: Settings, tmp_path: Path) -> None:
    value, _ = sample(knob)
    path = tmp_path / f"{knob.path}.json"
    save_settings(with_path(defaults, f"options.{knob.path}", value), path)
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert saved["options"][knob.section][knob.name] == value
    loaded, warning = load_settings(path, defaults)
    assert warning is None and get_path(loaded, f"options.{knob.path}") == value, (knob.path, warning)


def check_f4(knob: Knob, defaults: Settings) -> None:
    value, text = sample(knob)
    path = f"options.{knob.path}"
    assert (path, knob.setting.label) in screen_fields(defaults)
    if knob.kind is not bool:  # a Switch, not text
        typed = parse_value(path, text, get_path(defaults, path), strategy_rows(defaults)[path])
        assert typed == value and get_path(with_path(defaults, path, typed), path) == value


def check_server(knob: Knob, defaults: Settings) -> None:
    value, _ = sample(knob)
    assert knob.section in STRATEGIES, "a section is named after its strategy: the server picks it by name"
    assert knob.name in speculative_keys(defaults.options)[1][knob.section]
    strategy, options = speculation({"speculative": {"strategy": knob.section, knob.name: value}}, defaults, True)
    assert strategy == knob.section and get_path(options, knob.path) == value
    with pytest.raises(ApiError) as e:
        speculation({"speculative": {"strategy": knob.section, knob.name: [value]}}, defaults, True)
    assert e.value.param == f"speculative.{knob.name}"


def check_everywhere(knob: Knob, defaults: Settings, parse: Parse, tmp_path: Path) -> None:
    if knob.setting.flag is not None:
        check_cli(knob, parse, defaults.options)
    if knob.setting.label is not None:
        check_f4(knob, defaults)
    check_file(knob, defaults, tmp_path)
    check_server(knob, defaults)


# -- every declared field -------------------------------------------------------------------------------------------


ALL = knobs(StrategyOptions())


@pytest.mark.parametrize("knob", ALL, ids=[k.path for k in ALL])
def test_every_declared_field_shows_up_on_its_surfaces(knob: Knob, tmp_path: Path) -> None:
    check_everywhere(knob, Settings(), real_cli, tmp_path)
    if knob.setting.flag is not None:
        check_cli(knob, real_chat_flags, StrategyOptions())


def test_the_walk_sees_every_section_and_field() -> None:
    options = StrategyOptions()
    sections = [f.name for f in fields(options) if f.name != "memory"]
    assert sections == ["sps", "lookahead", "lookup", "tree", "auto", "suffix"]
    assert {k.path for k in knobs(options)} == {f"{s}.{f.name}" for s in sections for f in fields(getattr(options, s))}


def test_the_surfaces_are_todays() -> None:
    """Derived, they still spell what users know: the flags in their order, the F4 rows in theirs, the fan-out."""
    parser = build_parser()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    group = next(g for g in run._action_groups if g.title == "speculation")
    assert [name for action in group._group_actions for name in action.option_strings] == CLI_FLAGS
    rows = screen_fields(Settings())
    assert [r for r in rows if r[0].startswith("options.")] == F4_ROWS
    assert rows[:3] == (("target", "Target model"), ("draft", "Draft model"), ("strategy", "Strategy"))
    assert rows[-1] == ("speculation_view", "Speculation view")
    paths = flag_paths()
    assert {dest: paths[dest] for dest in FAN_OUT} == FAN_OUT
    assert paths["no_adaptive"] == ("options.sps.adaptive",) and paths["tree_nodes"] == ("options.tree.nodes",)
    keys = speculative_keys(StrategyOptions())[0]
    assert {key: tuple(f"options.{k.path}" for k in ks) for key, ks in keys.items()} == \
        {"n_max": FAN_OUT["draft_max"], "p_min": FAN_OUT["draft_p_min"]}


def test_a_number_or_a_word_is_read_in_one_place(tmp_path: Path) -> None:
    nodes = next(k for k in ALL if k.path == "tree.nodes")
    assert real_cli(["--tree-nodes", "auto"]).options.tree.nodes == "auto"
    assert real_cli(["--tree-nodes", "12"]).options.tree.nodes == 12
    assert parse_value("options.tree.nodes", " auto ", 8, nodes) == "auto"
    with pytest.raises(ValueError, match="a whole number or 'auto'"):
        parse_value("options.tree.nodes", "many", 8, nodes)
    # The kind is the declaration's, not the current value's: nodes now 'auto', p_min now the int 0.
    edited = with_path(with_path(Settings(), "options.tree.nodes", "auto"), "options.sps.p_min", 0)
    rows = strategy_rows(edited)
    assert parse_value("options.tree.nodes", "12", "auto", rows["options.tree.nodes"]) == 12
    assert parse_value("options.sps.p_min", "0.2", 0, rows["options.sps.p_min"]) == 0.2
    (tmp_path / "s.json").write_text('{"version": 2, "options": {"tree": {"nodes": "many"}}}')
    assert "int or 'auto'" in str(load_settings(tmp_path / "s.json")[1])
    with pytest.raises(ApiError, match="int or 'auto'"):
        speculation({"speculative": {"strategy": "tree", "nodes": "many"}}, Settings(), True)


def test_an_old_settings_file_still_loads(tmp_path: Path) -> None:
    """A file as earlier versions wrote it: every field, both memory switches, the tree's 'auto'."""
    old = {"version": 2, "target": "smollm2", "draft": "smollm2-draft", "strategy": "tree",
           "options": {"sps": {"draft_max": 5, "p_min": 0.3, "adaptive": False},
                       "lookahead": {"window": 3, "ngram": 4, "guesses": 3, "seed_pool_from_prompt": True},
                       "lookup": {"draft_max": 8, "ngram_max": 4, "ngram_min": 2},
                       "tree": {"depth": 5, "top_k": 3, "nodes": "auto", "shape": "static", "p_split": 0.2,
                                "p_min": 0.3},
                       "auto": {"draft": True, "lookup": False, "memory": True, "lookahead": True,
                                "explore_budget": 0.02, "draft_max": 10, "memory_paths": 4},
                       "suffix": {"depth": 12, "max_nodes": 20, "factor": 2, "min_prob": 0.2},
                       "suffix_cache": False},
           "suffix_cache": False, "suffix_cache_size": 200000}
    (tmp_path / "s.json").write_text(json.dumps(old))
    settings, warning = load_settings(tmp_path / "s.json")
    assert warning is None
    assert settings.options.tree.nodes == "auto" and settings.options.lookahead.seed_pool_from_prompt
    assert settings.options.suffix.factor == 2.0
    assert settings.memory is False and settings.memory_size == 200000 and settings.options.memory is False, \
        "the memory's settings under their earlier name"
    save_settings(settings, tmp_path / "again.json")
    again = json.loads((tmp_path / "again.json").read_text())
    today = {**{k: v for k, v in old.items() if not k.startswith("suffix_cache")}, "version": 3,
             "memory": False, "memory_size": 200000}
    today["options"] = {**{k: v for k, v in old["options"].items() if k != "suffix_cache"}, "memory": False}
    assert {key: again[key] for key in today} == today, "written back in today's shape, the same values"
    assert "suffix_cache" not in again and "suffix_cache" not in again["options"]


# -- declared in one place, shown on all four ----------------------------------------------------------------------


SUFFIX_DEPTH = Setting(flag=Flag(("--suffix-depth",), "suffix: deepest continuation proposed"), label="suffix: depth",
                       range=AT_LEAST_1)


def test_a_declaration_patched_in_one_place_appears_on_all_four(monkeypatch, tmp_path: Path) -> None:
    assert "--suffix-depth" not in build_parser().format_help() + real_help()
    assert "options.suffix.depth" not in dict(screen_fields(Settings()))
    declared = SuffixConfig.__dataclass_fields__["depth"]
    monkeypatch.setattr(declared, "metadata", MappingProxyType({SCHEMA_KEY: SUFFIX_DEPTH}))
    knob = next(k for k in knobs(StrategyOptions()) if k.path == "suffix.depth")
    assert knob.setting == SUFFIX_DEPTH
    assert "--suffix-depth" in real_help()
    check_everywhere(knob, Settings(), real_cli, tmp_path)
    check_cli(knob, real_chat_flags, StrategyOptions())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "hi", "-m", "x.gguf", "--suffix-depth"])


def real_help() -> str:
    return build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]


@dataclass(frozen=True)
class SpsPlus(SpsConfig):
    lookback: int = setting(3, flag=Flag(("--sps-lookback",), "sps: a setting added by this test"),
                            label="sps: lookback", range=Range(1))


@dataclass(frozen=True)
class OptionsPlus(StrategyOptions):
    sps: SpsPlus = field(default_factory=SpsPlus)


def test_a_new_field_on_a_subclass_appears_on_all_four(tmp_path: Path) -> None:
    defaults = Settings(options=OptionsPlus())
    knob = next(k for k in knobs(defaults.options) if k.path == "sps.lookback")
    check_everywhere(knob, defaults, cli_for(defaults), tmp_path)
    rows = [path for path, _ in screen_fields(defaults)]
    assert rows.index("options.sps.lookback") == rows.index("options.sps.adaptive") + 1, "in declaration order"
    with pytest.raises(ValueError, match="--sps-lookback must be at least 1"):  # its range, checked as declared
        SpsPlus(lookback=0)
    with pytest.raises(ApiError) as e:
        speculation({"speculative": {"strategy": "sps", "lookback": 0}}, defaults, True)
    assert "--sps-lookback must be at least 1" in e.value.message


def test_the_checks_notice_a_missing_surface(tmp_path: Path) -> None:
    """The checks can fail: a parser without the flags, a panel without the row, a server without the key."""
    knob = next(k for k in ALL if k.path == "lookahead.window")
    with pytest.raises((AssertionError, SystemExit)):
        check_cli(knob, lambda tail: apply_flags(Settings(), argparse.ArgumentParser().parse_args(tail)),
                  StrategyOptions())
    hidden = Knob(knob.path, knob.default, Setting(label="lookahead: window (not declared)"))
    with pytest.raises(AssertionError):
        check_f4(hidden, Settings())
    stranger = Knob("lookahead.width", 2, Setting())
    with pytest.raises(AssertionError):
        check_server(stranger, Settings())


# -- the F4 panel, mounted ------------------------------------------------------------------------------------------


class _PanelApp(App[None]):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.panel = SettingsScreen(settings)

    def on_mount(self) -> None:
        self.push_screen(self.panel)


def test_the_mounted_panel_edits_every_labelled_field(monkeypatch) -> None:
    """Every labelled field has its editor in the panel, and what is typed there comes back typed; the patched
    declaration's row is there too."""
    monkeypatch.setattr(SuffixConfig.__dataclass_fields__["depth"], "metadata",
                        MappingProxyType({SCHEMA_KEY: SUFFIX_DEPTH}))
    settings = Settings()
    rows = strategy_rows(settings)
    assert "options.suffix.depth" in rows

    async def scenario() -> Settings:
        app = _PanelApp(settings)
        async with app.run_test(size=(100, 60)) as pilot:
            await pilot.pause()
            for path, knob in rows.items():
                widget = app.panel.query_one("#f-" + path.replace(".", "-").replace("_", "-"))
                value, text = sample(knob)
                widget.value = value if knob.kind is bool else text
            await pilot.pause()
            return app.panel.collect()

    edited = asyncio.run(scenario())
    for path, knob in rows.items():
        assert get_path(edited, path) == sample(knob)[0], path
