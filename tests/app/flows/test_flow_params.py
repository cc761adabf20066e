"""The command's options cross the flow's edge unchanged (the signature against the field
table: tests/app/test_option_table.py)."""

from __future__ import annotations

import inspect

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe.config import choose_mode
from zerosafe_app.flows.convert import convert


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


@pytest.mark.slow
def test_a_flow_run_builds_its_options_once(prefect_server: None, tmp_path, monkeypatch) -> None:
    """Issue 38: the job is validated once, by `convert`; the subflow gets that very job config
    (Prefect does not validate a model instance again), so its `ConvertOptions` (and the mode
    it chose) are built once per run, not once per use."""
    from zerosafe_app.flows import config

    chosen: list[str] = []

    def counted(source_url: str, mode: str = "auto") -> tuple[bool, str]:
        chosen.append(mode)
        return choose_mode(source_url, mode)

    monkeypatch.setattr(config, "choose_mode", counted)
    result = convert(source=str(SAMPLE_CKPT), destination=str(tmp_path / "out"), mode="staged")
    assert result["status"] == "converted"
    assert chosen == ["staged"]
