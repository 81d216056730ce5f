"""What a strategy setting is called and allows, declared once beside its field.

Each field of a strategy's settings (backends.config) carries a `Setting` in
its dataclass metadata: its command-line flag, its row in the chat app's
settings panel (F4), its range or choices, and the words a number field also
takes (`auto`). A `Flag` that several fields share is a fan-out: `--draft-max`
sets every field that names it. The command line (app.cli), the flags' table
(app.settings), the F4 panel (app.tui.settings_screen), the settings file and
the server's per-request `speculative` object (app.serve.request) all derive
from the walk here (`knobs`, `strategy_flags`), so a field declared in one
place shows up on every surface.

"A number or a word" is read here only: `parse_text` for what a user types
(a flag, an F4 field), `json_value` for JSON (the settings file, a request).
Plain data and no project imports: `specchat --help` stays instant.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any

SCHEMA_KEY = "specchat"  # the key of a field's metadata that holds its Setting


@dataclass(frozen=True)
class Range:
    """A number's allowed interval; a bound of None is open-ended."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is outside
    high_open: bool = False

    def __post_init__(self) -> None:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"an empty range: {self}")

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"> {self.low:g}" if self.low_open else f"at least {self.low:g}"
        if self.low is None:
            return f"< {self.high:g}" if self.high_open else f"at most {self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


@dataclass(frozen=True)
class Flag:
    """A command-line flag. Several fields may name the same Flag: the flag sets them all (its fan-out)."""

    names: tuple[str, ...]  # as argparse takes them, short first: ("-W", "--lookahead-window")
    help: str  # without the default, which the command line adds from the fields
    sets: bool | None = None  # a switch (no value): what its presence sets; None: the flag takes a value
    request_key: str | None = None  # llama-server's name for the fan-out in a request's `speculative` object

    def __post_init__(self) -> None:
        if not self.names or not all(n.startswith("-") for n in self.names):
            raise ValueError(f"flag names start with '-': {self.names!r}")
        if not any(n.startswith("--") for n in self.names):
            raise ValueError(f"a flag needs a long name (--...): {self.names!r}")

    @property
    def dest(self) -> str:
        """The argparse attribute it lands in: its first long name, as argparse derives it."""
        return next(n for n in self.names if n.startswith("--"))[2:].replace("-", "_")


@dataclass(frozen=True)
class Setting:
    """One field's surfaces and rules. No flag: not on the command line; no label: not in the F4 panel.
    Every field is in the settings file and the server's `speculative` object."""

    flag: Flag | None = None
    label: str | None = None  # its row in the chat app's settings panel
    range: Range | None = None  # a number's interval (words excepted)
    choices: tuple[str, ...] = ()  # a word field's allowed words
    words: tuple[str, ...] = ()  # words a number field also takes (the tree's nodes: 'auto')


def setting(default: Any, **declared: Any) -> Any:
    """A dataclass field with this default and its Setting (the keywords of `Setting`)."""
    return field(default=default, metadata={SCHEMA_KEY: Setting(**declared)})


def setting_of(f: Field) -> Setting | None:
    return f.metadata.get(SCHEMA_KEY)


@dataclass(frozen=True)
class Knob:
    """A declared field, found by the walk: its path below the options ("sps.draft_max") and its declared
    default (whatever value the options hold, the kind is the declaration's)."""

    path: str
    default: Any
    setting: Setting

    @property
    def section(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def kind(self) -> type:
        """bool, int, float or str: the default's type (a number field whose default is a word: int)."""
        if isinstance(self.default, str) and self.default in self.setting.words:
            return int
        return type(self.default)

    def kind_text(self) -> str:
        """The value's kind, as an error message says it: 'a whole number or 'auto''."""
        what = {int: "a whole number", float: "a number", bool: "true or false"}.get(self.kind, "text")
        return what + self.or_words()

    def describe(self) -> str:
        """What a value must be, as an error message says it: its choices, range or kind."""
        if self.setting.choices:
            return f"one of {', '.join(self.setting.choices)}"
        return str(self.setting.range) + self.or_words() if self.setting.range else self.kind_text()

    def or_words(self) -> str:
        return "".join(f" or {w!r}" for w in self.setting.words)


def knobs(options: object) -> tuple[Knob, ...]:
    """Every field of every section of `options` (its dataclass fields that are dataclasses), in order."""
    out = []
    for section in fields(options):  # type: ignore[arg-type]
        value = getattr(options, section.name)
        if is_dataclass(value):
            out.extend(Knob(f"{section.name}.{f.name}", getattr(value, f.name) if f.default is MISSING else f.default,
                            setting_of(f) or Setting()) for f in fields(value))
    return tuple(out)


def strategy_flags(options: object) -> tuple[tuple[Flag, tuple[Knob, ...]], ...]:
    """Each flag once, in the order of its first field, with every field it sets."""
    fan_out: dict[Flag, list[Knob]] = {}
    for knob in knobs(options):
        if knob.setting.flag is not None:
            fan_out.setdefault(knob.setting.flag, []).append(knob)
    return tuple((flag, tuple(ks)) for flag, ks in fan_out.items())


def flag_default(knobs_set: tuple[Knob, ...]) -> Any:
    """A value flag's default: its fields' common default, or None when they differ (--draft-max)."""
    defaults = {repr(k.default) for k in knobs_set}
    return knobs_set[0].default if len(defaults) == 1 else None


def parse_text(knob: Knob, text: str) -> Any:
    """A typed value from what a user typed (a flag's value, an F4 field); ValueError says what it must be."""
    text = text.strip()
    if text in knob.setting.words:
        return text
    if knob.kind in (int, float):
        try:
            return knob.kind(text)
        except ValueError:
            raise ValueError(f"expected {knob.kind_text()}, got {text!r}") from None
    if knob.kind is bool:
        raise ValueError(f"{knob.path} is on or off, not text")
    return text


def json_value(knob: Knob, value: Any) -> Any:
    """A JSON value (the settings file, a request) checked against the field's kind; ValueError names the kind.
    An integer stands for a float; a word for a number field that also takes it."""
    if isinstance(value, str) and value in knob.setting.words:
        return value
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if knob.kind is float and is_number:
        return float(value)
    if (knob.kind is int and is_number and isinstance(value, int)) or \
            (knob.kind not in (int, float) and isinstance(value, knob.kind)):
        return value
    raise ValueError(knob.kind.__name__ + knob.or_words())


def check_fields(config: object, section: str) -> None:
    """`config`'s values against their declared ranges and choices (its __post_init__ calls this); the message
    names the flag, or the section's field when it has none."""
    for f in fields(config):  # type: ignore[arg-type]
        declared = setting_of(f)
        if declared is None:
            continue
        value = getattr(config, f.name)
        if isinstance(value, str) and value in declared.words:
            continue
        knob = Knob(f"{section}.{f.name}", f.default, declared)
        if declared.choices:
            ok = value in declared.choices
        elif knob.kind in (int, float) and (declared.range is not None or declared.words):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
                (knob.kind is float or isinstance(value, int)) and \
                (declared.range is None or declared.range.holds(value))
        else:
            continue
        if not ok:
            name = declared.flag.names[0] if declared.flag is not None else f"{section}'s {f.name}"
            raise ValueError(f"{name} must be {knob.describe()}")
