"""baton/flags.py: a declaration on a config field gives the parser its option (name, aliases, type, default,
choices, action) and the config its value back (inverted switches, environment fallbacks, enums, parsed
lists, nested configs); a table refuses an unknown owner or a name declared twice."""
from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from typing import Optional

import pytest

from baton.flags import FlagTable, declared_flags, flag, from_args, option

OWNERS = {"a": "component a", "b": "component b"}


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


def _pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


@dataclass(frozen=True)
class Inner:
    depth: int = flag(3, names=("--inner-depth",), help="nested", owner="b")
    unflagged: str = "kept"


@dataclass(frozen=True)
class Config:
    path: str = flag(help="required: no default", owner="a")
    size: Optional[int] = flag(None, help="an int", owner="a")
    ratio: float = flag(0.5, help="50% of it", owner="a")
    fast: bool = flag(False, help="a switch", owner="a")
    metrics: bool = flag(True, names=("--disable-metrics",), invert=True, help="inverted", owner="b")
    key: Optional[str] = flag(None, env="TEST_FLAGS_KEY", repr=False, help="secret", owner="b")
    color: Color = flag(Color.RED, help="an enum", owner="a", also=("b",))
    labels: dict[str, str] = flag(default_factory=dict, cli_default=[], nargs="+", parse=_pairs, help="K=V",
                                  owner="b")
    timeout: float = flag(60.0, names=("--timeout", "--timeout-secs"), help="with an alias", owner="a")
    inner: Inner = field(default_factory=Inner)
    built: tuple[str, ...] = ()


EXTRA = option("--extra", default=[], action="append", help="repeatable, no field", owner="a")


def table() -> FlagTable:
    return FlagTable(OWNERS, (*declared_flags(Config), EXTRA)).check()


def parse(*argv: str) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser()
    table().add_to(parser)
    args = parser.parse_args(["--path", "p", *argv])
    return args, from_args(Config, args, built=tuple(args.extra))


def test_the_parser_is_the_declarations():
    parser = argparse.ArgumentParser()
    table().add_to(parser)
    actions = {a.dest: a for a in parser._actions}
    assert not parser.allow_abbrev
    assert actions["path"].required and actions["path"].option_strings == ["--path"]
    assert actions["size"].type is int and actions["size"].default is None
    assert actions["ratio"].type is float and actions["ratio"].help == "50%% of it"  # argparse's escape
    assert actions["fast"].nargs == 0 and actions["fast"].default is False  # store_true
    assert actions["disable_metrics"].default is False
    assert actions["key"].type is None  # the string as given
    assert actions["color"].choices == ["red", "blue"] and actions["color"].default == "red"
    assert actions["labels"].nargs == "+" and actions["labels"].default == []
    assert actions["timeout"].option_strings == ["--timeout", "--timeout-secs"]
    assert actions["inner_depth"].default == 3
    assert actions["extra"].default == [] and "unflagged" not in actions
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert groups["b"] == ["disable_metrics", "key", "labels", "inner_depth"]


def test_defaults_give_the_configs_defaults(monkeypatch):
    monkeypatch.delenv("TEST_FLAGS_KEY", raising=False)
    _, config = parse()
    assert config == Config("p")


def test_each_kind_of_flag_fills_its_field(monkeypatch):
    monkeypatch.setenv("TEST_FLAGS_KEY", "from-env")
    _, config = parse("--size", "8", "--fast", "--disable-metrics", "--color", "blue", "--labels", "a=1", "b=2",
                      "--timeout-secs", "5", "--inner-depth", "7", "--extra", "x", "--extra", "y")
    assert (config.size, config.fast, config.metrics, config.color) == (8, True, False, Color.BLUE)
    assert config.key == "from-env" and config.labels == {"a": "1", "b": "2"} and config.timeout == 5.0
    assert config.inner == Inner(depth=7) and config.built == ("x", "y")
    assert parse("--key", "flag")[1].key == "flag"


def test_a_flag_missing_from_the_namespace_leaves_the_default():
    assert from_args(Config, argparse.Namespace(path="p", size=2)) == Config("p", size=2)


def test_a_table_refuses_unknown_owners_and_names_declared_twice():
    with pytest.raises(AssertionError, match="unknown owner"):
        FlagTable({"a": "only a"}, tuple(declared_flags(Config))).check()
    with pytest.raises(AssertionError, match="declared twice"):
        FlagTable(OWNERS, (*declared_flags(Config), option("--size", help="again", owner="a"))).check()


def test_a_declaration_needs_help_and_an_owner():
    with pytest.raises(AssertionError, match="help and an owner"):
        option("--x", help="", owner="a")


def test_each_component_view_reads_only_flags_declared_as_its_own():
    """The scheduler's parts, the worker, PD and speculation read config views, not ServerArgs: every view field is a
    flag of the same name and type whose declaration names that component (owner or `also`)."""
    import dataclasses
    import typing

    from baton.engine.disaggregation.config import PDConfig
    from baton.engine.model_executor.config import WorkerConfig
    from baton.engine.scheduler.config import SchedulerConfig
    from baton.engine.server_args import ServerArgs
    from baton.engine.speculative.config import SpecConfig
    from baton.flags import declared_flags

    declared = {f.field: f for f in declared_flags(ServerArgs)}
    hints = typing.get_type_hints(ServerArgs)
    views = ((SchedulerConfig, ("scheduler",)), (PDConfig, ("pd",)), (SpecConfig, ("speculative",)),
             (WorkerConfig, ("worker", "model")))  # the worker loads the checkpoint: the model's flags too
    for view, owners in views:
        view_hints = typing.get_type_hints(view)
        for f in dataclasses.fields(view):
            flag = declared.get(f.name)
            assert flag is not None, f"{view.__name__}.{f.name} is no flag of baton serve"
            assert {flag.owner, *flag.also} & set(owners), f"{flag.names[0]} is not declared as read by {owners}"
            assert hints[f.name] in (view_hints[f.name], typing.Optional[view_hints[f.name]]), f.name
        args = ServerArgs(model_path="m", page_size=4, disaggregation_bootstrap_port=9999)
        built = args.view(view)
        assert all(getattr(built, f.name) == getattr(args, f.name) for f in dataclasses.fields(view))
