"""Declarations of the ``TISConfig`` fields: one :class:`Option` per field (flag, host aliases, kind, choices or valid
range, help, start-up line), the single source of its argparse flag (:func:`add_options`), its dests
(:func:`fields_from_args`), its validation (:meth:`Option.problem`) and its row of docs/reference.md's flag table
(:func:`flag_table`; ``python scripts/reference_tables.py --write``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Option", "option", "threshold", "divergence_threshold", "surrogate_option", "declared_fields", "RANGES",
           "SWITCH_WORDS", "parse_switch", "add_options", "fields_from_args", "flag_table"]

#: Spellings of a switch's value (case-insensitive strings; YAML quotes keep ``"false"`` a string).
SWITCH_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}

#: Largest ``--tis-safety-bound``: ``exp(B)`` is float32's largest value at ``B = 88.7``; at 60, ``exp(B) = 1.1e26``
#: leaves a factor 3e12 for the advantages and the sums over tokens in which clamped ratios appear.
MAX_SAFETY_BOUND = 60.0

#: Valid ranges of a number: the test and the words of the error message.
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "> 0": (lambda v: v > 0, "must be > 0"),
    ">= 0": (lambda v: v >= 0, "must be >= 0"),
    "> 1": (lambda v: v > 1, "must be > 1"),
    "in (0, 1)": (lambda v: 0 < v < 1, "must lie in (0, 1)"),
    "in [0, 1)": (lambda v: 0 <= v < 1, "must lie in [0, 1)"),
    f"in (0, {MAX_SAFETY_BOUND:g}]": (lambda v: 0 < v <= MAX_SAFETY_BOUND, f"must lie in (0, {MAX_SAFETY_BOUND:g}]"),
    ">= 1": (lambda v: v >= 1, "must be >= 1"),
    "integer in [1, 16]": (lambda v: 1 <= v <= 16 and float(v).is_integer(), "must be an integer in [1, 16]"),
}

KINDS = ("switch", "choice", "number")


@dataclass(frozen=True)
class Option:
    """One command-line option: ``flag`` (dest: without ``--``, ``-`` -> ``_``) and host ``aliases``; ``help`` ending
    with the effective default; ``kind`` ``switch`` / ``choice`` (``choices``) / ``number`` (``valid``: a key of
    :data:`RANGES`, ``why`` appended to its words; ``words``: strings it also takes);
    ``describe``: the ``describe()`` line while set (``{value:g}``); ``readme`` / ``metavar``: the reference table's."""

    flag: str
    help: str
    kind: str = "number"
    choices: tuple[str, ...] | None = None
    valid: str | None = None
    why: str = ""
    describe: str = ""
    aliases: tuple[str, ...] = ()
    readme: str = ""
    metavar: str = ""
    words: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Option {self.flag}: kind = {self.kind!r}: must be one of {', '.join(KINDS)}")
        if self.valid is not None and self.valid not in RANGES:
            raise ValueError(f"Option {self.flag}: valid = {self.valid!r}: must be one of {', '.join(RANGES)}")
        if (self.kind == "choice") != (self.choices is not None):
            raise ValueError(f"Option {self.flag}: choices are given exactly for kind 'choice'")

    @property
    def dest(self) -> str:
        return _dest(self.flag)

    @property
    def dests(self) -> tuple[str, ...]:
        """Every argparse dest that may carry the value: ours first, then the aliases'."""
        return (self.dest, *(_dest(a) for a in self.aliases))

    def problem(self, value: Any, allow_none: bool) -> str | None:
        """The error text for an invalid ``value`` of this option, or None when it is valid."""
        if value is None and allow_none:
            return None
        if self.kind == "switch":
            return None if isinstance(value, bool) else "must be a bool"
        if self.kind == "choice":
            if value in self.choices:
                return None
            return f"must be one of {', '.join(self.choices)}" + (" or None" if allow_none else "")
        if isinstance(value, str) and value in self.words:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return "must be a finite number" + "".join(f" or {w!r}" for w in self.words)
        if self.valid is None:
            return None
        ok, words = RANGES[self.valid]
        if ok(value):
            return None
        return words + (f" ({self.why})" if self.why else "")


def _number_or(words: tuple[str, ...]) -> Callable[[str], float | str]:
    """argparse ``type`` of a number that also takes ``words``."""
    def parse(text: str) -> float | str:
        return text if text in words else float(text)

    parse.__name__ = "number"  # argparse names the type in its error message
    return parse


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def option(default: Any, **declaration: Any) -> Any:
    """A ``TISConfig`` field with default ``default`` carrying an :class:`Option`."""
    return dataclasses.field(default=default, metadata={"option": Option(**declaration)})


def threshold(**declaration: Any) -> Any:
    """A rejection rule's threshold: a number field, ``None`` (the rule off) by default."""
    declared = Option(**declaration)
    return dataclasses.field(default=None, metadata={"option": declared, "threshold": declared})


#: The per-token divergences of verl's rejection options (``core.rules.DIVERGENCES``), in words.
DIVERGENCE_WORDS = {"k2": "k2 = (log r)^2 / 2", "k3": "k3 = r - 1 - log r"}


def divergence_threshold(name: str) -> Any:
    """The :func:`threshold` of verl's rejection option ``name`` = ``<statistic>_<k>``: field ``<name>_threshold``,
    flag ``--tis-<name>-threshold``, valid ``> 0``."""
    statistic, k = name.rsplit("_", 1)
    words = DIVERGENCE_WORDS[k]
    unit, of = ("token", "") if statistic == "token" else ("sequence", statistic.removeprefix("seq_"))
    return threshold(
        flag=f"--tis-{name.replace('_', '-')}-threshold", valid="> 0", why=f"{words} >= 0",
        help=f"Reject a {unit} whose {of + ' over valid tokens of ' if of else ''}{words} exceeds this (> 0), as "
             f"verl's {name}. Default: off.",
        describe=f"{k} rejection: reject {unit}s whose {of + ' of ' if of else ''}{words} > {{value:g}}")


def surrogate_option(surrogate: str, default: float, **declaration: Any) -> Any:
    """An option of one surrogate: in ``Plan.surrogate_params`` while that surrogate is chosen."""
    return dataclasses.field(default=default, metadata={"option": Option(**declaration), "surrogate": surrogate})


def declared_fields(config: Any, key: str) -> dict[str, Any]:
    """``{field name: metadata[key]}`` of the fields of a ``TISConfig`` class declaring ``key``, in field order:
    ``"option"`` (every field's :class:`Option`), ``"threshold"`` (the thresholds'), ``"surrogate"`` (the name of
    the surrogate an option belongs to)."""
    return {f.name: f.metadata[key] for f in dataclasses.fields(config) if key in f.metadata}


def parse_switch(name: str, value: Any) -> bool:
    """A switch's value: a bool, 0 / 1, or one of :data:`SWITCH_WORDS`; anything else raises ``ValueError`` naming
    ``name`` and the value (a quoted ``"false"`` never turns a switch on)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in SWITCH_WORDS:
        return SWITCH_WORDS[value.strip().lower()]
    raise ValueError(f"{name} = {value!r}: expected a boolean (true/false, yes/no, on/off or 1/0)")


def add_options(parser: argparse.ArgumentParser, options: list[Option], title: str,
                description: str | None = None) -> argparse.ArgumentParser:
    """Add ``options`` to ``parser`` in one group, reusing any flag it already defines; returns it."""
    existing = parser._option_string_actions  # argparse keeps every registered option string here
    existing_dests = {a.dest for a in parser._actions}
    group = parser.add_argument_group(title, description)
    for declared in options:
        strings = [declared.flag, *declared.aliases]
        free = [s for s in strings if s not in existing]
        if not free or (declared.dest in existing_dests and len(free) < len(strings)):
            continue  # the host already defines this option: reuse it
        if declared.kind == "switch":
            kind = dict(action="store_true")
        elif declared.kind == "choice":
            kind = dict(choices=list(declared.choices))
        else:
            kind = dict(type=_number_or(declared.words) if declared.words else float)
        group.add_argument(*free, dest=declared.dest, default=None, help=declared.help, **kind)  # None: not given
    return parser


def fields_from_args(options: dict[str, Option], args: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` updated with every option given in ``args`` (any of its dests); a switch is on if any dest is
    (:func:`parse_switch`), else keeps its value in ``fields`` (a preset's) or is off."""
    for field, declared in options.items():
        given = {d: getattr(args, d) for d in declared.dests if getattr(args, d, None) is not None}
        if declared.kind == "switch":
            if any([parse_switch(f"{declared.flag} ({d})", v) for d, v in given.items()]):
                fields[field] = True
            else:
                fields.setdefault(field, False)
        elif given:
            fields[field] = next(iter(given.values()))
    return fields


def flag_table(options: list[Option]) -> str:
    """The flag table of docs/reference.md (markdown), one row per option in declaration order."""
    rows = ["| flag | meaning and default |", "|---|---|"]
    for declared in options:
        flags = ", ".join(f"`{s}`" for s in (declared.flag, *declared.aliases))
        if declared.metavar:  # a named value (its choices are listed elsewhere)
            flags = f"`{declared.flag} {declared.metavar}`"
        elif declared.kind == "choice":
            flags += " {" + ",".join(declared.choices) + "}"
        rows.append(f"| {flags} | {declared.readme or declared.help} |")
    return "\n".join(rows) + "\n"
