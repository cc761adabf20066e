"""One field list (`zerosafe_app.option_table.JOB_FIELDS`, issue 38): the flow's signature,
`JobConfig`, `ConvertOptions` and the command's flags all agree with it, names, defaults and
types, so a new option is one row (plus its declarations, which these tests hold to it)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import textwrap
import typing

import pytest

from zerosafe.config import ConvertOptions, Mode
from zerosafe.errors import ConfigError
from zerosafe_app.cli import _options, _parser, with_flag_names
from zerosafe_app.flows.config import JobConfig, flow_parameters, load_job_config
from zerosafe_app.flows.convert import convert
from zerosafe_app.option_table import FLAG_OF_FIELD, JOB_FIELDS, Kind, Scope, field_named

_FLOW_TYPE = {
    Kind.TEXT: "str | None",
    Kind.URL: "str | None",
    Kind.CHOICE: "str | None",
    Kind.SWITCH: "bool | None",
    Kind.COUNT: "int | None",
    Kind.SIZE: "str | None",
    Kind.PATTERNS: "list[str] | None",
    Kind.MAPPING: "dict[str, Any] | None",
}
"""The flow parameter's annotation of each kind: Prefect's form and `--param` parse by it."""


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_flow_signature_is_the_table() -> None:
    """The signature stays written out (Prefect reads it, deployments included, from the
    source); each parameter is a row, in any order, with no default but None, typed by kind."""
    parameters = inspect.signature(convert.fn).parameters
    assert set(parameters) == {"conf"} | {f.name for f in JOB_FIELDS}
    for name, parameter in parameters.items():
        assert parameter.default is None, name
        want = "str | None" if name == "conf" else _FLOW_TYPE[field_named(name).kind]
        assert parameter.annotation == want, name


def test_the_flow_hands_every_parameter_to_the_job_config() -> None:
    """The flow's first statement takes its parameters, all but `conf`, before any other local
    exists; `load_job_config` gets them by name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(convert.fn))).body[0]
    assert isinstance(body, ast.FunctionDef)
    first = body.body[1]  # after the docstring
    assert isinstance(first, ast.Assign) and ast.unparse(first.targets[0]) == "params"
    assert "locals()" in ast.unparse(first.value) and "'conf'" in ast.unparse(first.value)


def test_job_config_is_the_table() -> None:
    assert set(JobConfig.model_fields) == {f.name for f in JOB_FIELDS}
    for field in JOB_FIELDS:
        info = JobConfig.model_fields[field.name]
        if info.is_required():
            assert field.default is None, field.name
        else:
            assert info.get_default(call_default_factory=True) == field.default, field.name
    assert JobConfig.model_fields["mode"].annotation is Mode
    for field in JOB_FIELDS:
        if field.kind is Kind.CHOICE:  # the command's choices are the job config's
            assert _choices(JobConfig.model_fields[field.name].annotation) == field.choices


def _choices(annotation: object) -> tuple[str, ...]:
    """The strings a `Literal[...]` (or `Literal[...] | None`, or a `StrEnum`) allows."""
    if isinstance(annotation, type) and issubclass(annotation, enum.StrEnum):
        return tuple(annotation)
    found: list[str] = []
    for arg in typing.get_args(annotation):
        found += [arg] if isinstance(arg, str) else list(_choices(arg))
    return tuple(found)


def test_the_engine_options_are_the_table_s_engine_rows() -> None:
    """Every `ConvertOptions` field but what `mode` decides is an engine row of the same name,
    with the same default."""
    engine = {f.name: f for f in JOB_FIELDS if f.engine}
    fields = {f.name: f for f in dataclasses.fields(ConvertOptions)}
    assert set(fields) - {"direct", "mode_reason"} == set(engine)
    default = ConvertOptions()
    cfg = load_job_config(None, source="/a", destination="/b")
    for name in engine:
        assert getattr(cfg.options(), name) == getattr(default, name), name


def test_every_flag_is_a_command_s_and_parses_to_the_table_default() -> None:
    commands = _commands()
    for field in JOB_FIELDS:
        if field.scope is Scope.NONE:
            continue
        names = ("inspect", "convert") if field.scope is Scope.PLAN else ("convert",)
        for name in names:
            (action,) = [a for a in commands[name]._actions if field.flag in a.option_strings]
            assert action.dest == field.name, (name, field.flag)
    args = _parser().parse_args(["convert", "/ckpt", "/out"])
    cfg = load_job_config(None, source="/ckpt", destination="/out")
    for field in JOB_FIELDS:
        if field.scope is not Scope.NONE and field.name != "max_parallel_tasks":
            given = getattr(args, field.name)
            assert given == field.default or (given is None and field.default == []), field.name
    # `--parallel`'s default is the machine's; the rest give the job config's options
    assert _options(args) == dataclasses.replace(
        cfg.options(), max_parallel_tasks=args.max_parallel_tasks
    )


def test_messages_name_the_flags_a_user_typed() -> None:
    """Every flag of the map exists on a command, and an engine message naming fields reads
    with the flags."""
    flags = {o for p in _commands().values() for a in p._actions for o in a.option_strings}
    for flag in FLAG_OF_FIELD.values():
        assert flag.strip("`").split(" ")[0] in flags, flag
    e = ConfigError("`memory` too small for `max_parallel_tasks`; use `mode: staged`")
    assert str(with_flag_names(e)) == "`--memory` too small for `--parallel`; use `--mode staged`"
    with pytest.raises(ConfigError, match="`--no-model-files` nothing is copied"):
        _options(_parser().parse_args(["convert", "/c", "/o", "--quantize", "fp8-block",
                                       "--no-model-files"]))  # fmt: skip


def test_the_options_are_computed_once_per_job_config(monkeypatch) -> None:
    """`JobConfig.options()` is the value its validation built, and validating the instance
    again (a subflow's parameter) keeps it."""
    from zerosafe_app.flows import config

    cfg = load_job_config(None, source="/ckpt", destination="/out", mode="staged")
    assert cfg.options() is cfg.options()
    built = cfg.options()
    monkeypatch.setattr(config, "choose_mode", None)  # never called again
    assert JobConfig.model_validate(cfg) is cfg and cfg.options() is built
    monkeypatch.undo()
    assert cfg.mode is Mode.STAGED and not cfg.options().direct
    params = flow_parameters("/ckpt", "/out", cfg.options(), mode=Mode.STAGED)
    assert params["mode"] == "staged" and type(params["mode"]) is str
