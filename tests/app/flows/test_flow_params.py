"""The flow `convert` hands every parameter to the job config by name (no `locals()`), and
its parameters are exactly the job config's fields plus `conf`."""

from __future__ import annotations

import ast
import inspect
import textwrap

from zerosafe_app.flows.config import JobConfig
from zerosafe_app.flows.convert import convert


def test_every_flow_parameter_reaches_the_job_config() -> None:
    parameters = [n for n in inspect.signature(convert.fn).parameters if n != "conf"]
    assert sorted(parameters) == sorted(JobConfig.model_fields)
    tree = ast.parse(textwrap.dedent(inspect.getsource(convert.fn)))
    (call,) = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "params" for t in node.targets)
    ]
    assert isinstance(call, ast.Call)
    passed = {k.arg: k.value.id for k in call.keywords if isinstance(k.value, ast.Name)}
    assert passed == {name: name for name in parameters}


def test_the_command_options_cross_the_flow_edge_unchanged(tmp_path) -> None:
    """Options have one form from the command line to the copy loop: the command builds its
    `ConvertOptions` once, `flow_parameters` is the one conversion to the flow's JSON
    parameters, and the flow's job config gives the same options back (dtype, sizes and mode
    included), which its tasks then get as they are."""
    from zerosafe_app.cli import _options, _parser
    from zerosafe_app.flows.config import flow_parameters, load_job_config

    out = str(tmp_path / "out")
    argv = [
        "convert", "/ckpt", out, "--dtype", "bf16", "--memory", "256MiB", "--max-shard-size",
        "20KB", "--parallel", "3", "--mode", "staged", "--tied", "copy", "--exclude-frozen",
        "--keep-fp32", "norm", "--keep-fp32", "router", "--overwrite", "--keep-work",
        "--allow-nonfinite", "--check-lowp", "--file-sha256", "--select", "model.",
        "--strip-prefix", "", "--keep-names", "--model-files", str(tmp_path), "--work-dir", str(tmp_path / "w"),
    ]  # fmt: skip
    args = _parser().parse_args(argv)
    options = _options(args)
    params = flow_parameters(
        "/ckpt", out, options, mode=args.mode, work_dir=args.work_dir, storage_options={}
    )
    parameters = {n for n in inspect.signature(convert.fn).parameters if n != "conf"}
    assert set(params) <= parameters
    assert params["dtype"] == "bf16" and params["memory"] == str(256 * 2**20)
    cfg = load_job_config(None, **params)
    assert cfg.options() == options and options.keep_names
    assert (cfg.work_dir, cfg.mode) == (str(tmp_path / "w"), "staged")
    auto = _options(_parser().parse_args(["convert", "/ckpt", out]))
    again = load_job_config(None, **flow_parameters("/ckpt", out, auto, mode="auto")).options()
    assert again == auto and again.direct and again.dtype == "float32"
