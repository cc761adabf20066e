"""Every bad option value is one line naming the flag the user typed, exit 2, no traceback:
not an internal field (`max_parallel_tasks`), not argparse's usage block, not a
ZeroDivisionError from a zero in a list."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe_app.cli import main

SIM = str(Path(__file__).parents[2] / "conf" / "simulate-80b.yaml")
CKPT = str(SAMPLE_CKPT)

BAD = [
    # (argv, the flag the one line must name)
    (["convert", CKPT, "OUT", "--parallel", "0"], "--parallel"),
    (["convert", CKPT, "OUT", "--parallel", "-3"], "--parallel"),
    (["convert", CKPT, "OUT", "--parallel", "two"], "--parallel"),
    (["convert", CKPT, "OUT", "--memory", "0"], "--memory"),
    (["convert", CKPT, "OUT", "--memory", "1KB"], "--memory"),
    (["convert", CKPT, "OUT", "--memory", "-1GB"], "--memory"),
    (["convert", CKPT, "OUT", "--memory", "99999999999999999999PB"], "--memory"),
    (["convert", CKPT, "OUT", "--max-shard-size", "0"], "--max-shard-size"),
    (["convert", CKPT, "OUT", "--max-shard-size", "5XB"], "--max-shard-size"),
    (["convert", CKPT, "OUT", "--dtype", "fp8"], "--dtype"),
    (["convert", CKPT, "OUT", "--tied", "share"], "--tied"),
    (["inspect", CKPT, "--memory", "0"], "--memory"),
    (["inspect", CKPT, "--parallel", "0"], "--parallel"),
    (["inspect", CKPT, "--world-size", "4"], "--world-size"),
    (["inspect", CKPT, "--workers", "2"], "--workers"),
    (["inspect", "--simulate", SIM, "--world-size", "0"], "--world-size"),
    (["inspect", "--simulate", SIM, "--workers", "0"], "--workers"),
    (["inspect", "--simulate", SIM, "--workers", "1,x"], "--workers"),
    (["inspect", "--simulate", SIM, "--bandwidth", "0"], "--bandwidth"),
    (["inspect", "--simulate", SIM, "--task-rate", "0"], "--task-rate"),
    (["inspect", "--simulate", SIM, "--request-latency", "-1"], "--request-latency"),
    (["inspect", "--simulate", SIM, "--request-latency", "nan"], "--request-latency"),
    (["inspect", "--simulate", SIM, "--extract-part-size", "1KB"], "--extract-part-size"),
    (["inspect", "--simulate", SIM, "--parallel", "0"], "--parallel"),
    (["inspect", "--simulate", SIM, "--memory", "1MB"], "--memory"),
    (["verify", "OUT", "--storage-option", "x"], "--storage-option"),
    (["pt2st", "x.pt", "--memory", "0"], "--memory"),
    (["pt2st", "x.pt", "--memory", "lots"], "--memory"),
    (["clean", "OUT", "--older-than", "soon"], "--older-than"),
    (["clean", "OUT", "--older-than", "-1h"], "--older-than"),
]

INTERNAL = ("max_parallel_tasks", "`memory`", "`max_shard_size`", "`extract_part_size`", "_bytes")


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[" ".join(a[2:] or a) for a, _ in BAD])
def test_bad_option_is_one_line_naming_the_flag(
    argv: list[str], flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)  # relative OUT and x.pt land here, and nothing may
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err and "Traceback" not in err, err
    assert not any(name in err for name in INTERNAL), err
    assert list(tmp_path.iterdir()) == []


def test_a_file_given_as_the_checkpoint_says_what_to_give(tmp_path: Path, capsys) -> None:
    import torch

    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, pt)
    rank_file = next((SAMPLE_CKPT / "global_step2").glob("*model_states.pt"))
    for argv, fix in [
        (["inspect", str(pt)], f"zerosafe pt2st {pt}"),
        (["convert", "--via", "local", str(pt), str(tmp_path / "o")], f"zerosafe pt2st {pt}"),
        (["inspect", str(rank_file)], f"tag folder '{rank_file.parent}'"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "is a file; expected" in err, err
        assert fix in err and "no such" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
