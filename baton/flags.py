"""Each command-line flag declared once, on the config field it fills, and the parser built from that.

A declaration holds the flag's name, type, default, help and the component that reads it; the argparse
parser, docs/flags.md and the operator's list of known flags are all generated from the declarations
(scripts/gen_flags.py writes the last two)."""
from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

_KEY = "baton.flag"


@dataclass(frozen=True)
class Flag:
    """One flag, resolved. On a config field (`flag()`) the name, default, type and choices come from the
    field unless stated; `option()` declares a flag that fills no single field (its config builder
    combines it with others)."""

    help: str
    owner: str  # the component that reads it: a key of its command's FlagTable.owners
    also: tuple[str, ...] = ()  # the other components that read it
    names: tuple[str, ...] = ()  # the option strings, aliases after the first
    default: Any = None  # what the parser stores when the flag is absent
    type: Optional[Callable[[str], Any]] = None  # None: the string as given
    choices: Optional[Sequence[Any]] = None
    action: Optional[str] = None  # "store_true", "append"; None: store
    nargs: Optional[str | int] = None
    metavar: Optional[str] = None
    required: bool = False
    env: Optional[str] = None  # read where the flag is absent or empty (keeps a secret out of argv)
    invert: bool = False  # the field holds the opposite: --disable-x fills enable_x
    parse: Optional[Callable[[Any], Any]] = None  # the parsed value -> the field's value (None stays None)
    field: Optional[str] = None  # the config field it fills; None for option()

    def __post_init__(self) -> None:
        assert self.names and all(n.startswith("-") for n in self.names), self.names
        assert self.help and self.owner, f"{self.names[0]}: a flag needs help and an owner"

    @property
    def dest(self) -> str:
        """The parsed namespace's attribute: argparse's rule, the first long name with underscores."""
        return next(n for n in self.names if n.startswith("--"))[2:].replace("-", "_")

    def value(self, parsed: Any) -> Any:
        """The field's value for what the parser stored."""
        if self.env is not None and not parsed:
            parsed = os.environ.get(self.env) or None
        if self.invert:
            return not parsed
        return parsed if self.parse is None or parsed is None else self.parse(parsed)

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        kwargs: dict[str, Any] = {"default": self.default, "help": self.help.replace("%", "%%")}
        for key in ("action", "type", "choices", "nargs", "metavar"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        if self.required:
            kwargs["required"] = True
        parser.add_argument(*self.names, **kwargs)


class FlagTable(NamedTuple):
    """A command's flags and the components that read them (owner -> what it is, in the order shown)."""

    owners: dict[str, str]
    flags: tuple[Flag, ...]

    def check(self) -> "FlagTable":
        """Each owner known, each name and destination used once."""
        for f in self.flags:
            assert {f.owner, *f.also} <= self.owners.keys(), f"{f.names[0]}: unknown owner in {f.owner, *f.also}"
        names = [n for f in self.flags for n in f.names]
        dests = [f.dest for f in self.flags]
        assert len(set(names)) == len(names) and len(set(dests)) == len(dests), "a flag declared twice"
        return self

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Adds every flag, one argument group per owner; abbreviations refused, since the operator's
        managed-flags rule matches whole names (`--kv-cache-dtyp` would pass it)."""
        parser.allow_abbrev = False
        for owner, what in self.owners.items():
            group = parser.add_argument_group(owner, what)
            for f in self.flags:
                if f.owner == owner:
                    f.add_to(group)


def flag(default: Any = MISSING, *, default_factory: Any = MISSING, cli_default: Any = MISSING, repr: bool = True,
         **declared: Any) -> Any:
    """A dataclass field with its flag: `declared` holds Flag's arguments (help and owner at least);
    `cli_default` is what the parser stores where that differs from the field's default (a list of
    KEY=VALUE strings for a dict field)."""
    if cli_default is not MISSING:
        declared["default"] = cli_default
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr,
                             metadata={_KEY: declared})


def option(*names: str, default: Any = None, **declared: Any) -> Flag:
    """A flag that fills no single field of the config."""
    action = "store_true" if default is False and "action" not in declared else declared.pop("action", None)
    return Flag(names=names, default=default, action=action, **declared)


def declared_flags(cls: type) -> list[Flag]:
    """The flags on `cls`'s fields, and on the fields of the config dataclasses it nests, in field order."""
    hints = typing.get_type_hints(cls)
    out: list[Flag] = []
    for f in dataclasses.fields(cls):
        if _KEY in f.metadata:
            out.append(_resolve(f, hints[f.name]))
        elif _has_flags(hints[f.name]):
            out.extend(declared_flags(hints[f.name]))
    return out


def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` built from parsed flags: each flagged field from its flag (a flag missing from `args` leaves
    the field's default), each nested config alike; `given` fields as given."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kwargs[f.name] = given[f.name]
        elif _KEY in f.metadata:
            spec = _resolve(f, hints[f.name])
            if hasattr(args, spec.dest):
                kwargs[f.name] = spec.value(getattr(args, spec.dest))
        elif _has_flags(hints[f.name]):
            kwargs[f.name] = from_args(hints[f.name], args)
    return cls(**kwargs)


def _is_class(hint: Any) -> bool:
    return isinstance(hint, type) and typing.get_origin(hint) is None  # list[int] passes isinstance(type)


def _has_flags(hint: Any) -> bool:
    return _is_class(hint) and dataclasses.is_dataclass(hint) and \
        any(_KEY in f.metadata for f in dataclasses.fields(hint))


def _resolve(f: dataclasses.Field, hint: Any) -> Flag:
    """A field's flag: what its declaration states, the rest from the field's name, default and type."""
    base = _without_none(hint)
    derived: dict[str, Any] = {"names": ("--" + f.name.replace("_", "-"),), "field": f.name}
    default = None if f.default is MISSING else f.default
    derived["required"] = f.default is MISSING and f.default_factory is MISSING
    if base is bool:
        derived["action"], default = "store_true", False  # an inverted flag fills a True default
    elif base in (int, float):
        derived["type"] = base
    elif _is_class(base) and issubclass(base, enum.Enum):
        derived["choices"], derived["parse"] = [m.value for m in base], base
        default = default.value if isinstance(default, enum.Enum) else default
    derived["default"] = default
    return Flag(**{**derived, **f.metadata[_KEY]})


def _without_none(hint: Any) -> Any:
    """X for Optional[X] and X | None, else the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint
