"""The DeepSpeed checkpoints the training-state tests share, trained once per session: four
runs at world size 4 (`TRAINED`) and three shared fixtures (`SHARED`), each also turned
universal by DeepSpeed's own `ds_to_universal.py` (the reference of `--to universal` and
`--to dcp`). Set ZEROSAFE_DS_CACHE=/some/dir to keep the trained checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SHARED_FIXTURES
from tests.deepspeed_gen import SPECS, ds_to_universal_many, spec_key, train_checkpoint

TRAINED = [
    "uc-z1-bf16-ws4-tied-frozen-groups",
    "uc-z1-bf16opt-ws4-tied-frozen",
    "uc-z2-fp32-ws4-cpuadam",
    "uc-z3-bf16-ws4-tied-frozen-subgroups",
]
SHARED = [
    "z2-fp16-ws4-tied",
    "z3-fp32-ws4-tied-2groups-persist",
    "z1-bf16-ws2-fp32accum-bf16optimizer",
]


@dataclass
class Source:
    name: str
    ckpt: Path
    """The ZeRO checkpoint folder (holding `latest`)."""
    tag: str
    ds: Path
    """ds_to_universal.py's output: the folder holding `latest_universal`."""
    spec: dict[str, Any] | None

    @property
    def ds_folder(self) -> Path:
        return self.ds / f"{self.tag}_universal"


def _trained_ckpt(name: str, tmp: Path) -> Path:
    spec = SPECS[name]
    cache_env = os.environ.get("ZEROSAFE_DS_CACHE")
    if not cache_env:
        return train_checkpoint(spec, tmp / name)
    root = Path(cache_env).expanduser() / f"uc-{name}-{spec_key(spec)}"
    if not (root / "done.json").is_file():
        scratch = root.with_name(f".{root.name}.{os.getpid()}.tmp")
        shutil.rmtree(scratch, ignore_errors=True)
        train_checkpoint(spec, scratch)
        (scratch / "done.json").write_text(json.dumps(spec))
        shutil.rmtree(root, ignore_errors=True)
        scratch.rename(root)
    return root / "ckpt"


def shared_checkpoint(name: str) -> Path:
    ckpt = SHARED_FIXTURES / name / "checkpoint"
    if not ckpt.is_dir():
        pytest.skip(f"shared fixture {name} is absent ({SHARED_FIXTURES})")
    return ckpt


@pytest.fixture(scope="session")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Source]:
    """Every checkpoint, trained (or cached) and turned universal by DeepSpeed, all in one
    ds_to_universal.py process."""
    tmp = tmp_path_factory.mktemp("uc-sources")
    ckpts = {name: _trained_ckpt(name, tmp) for name in TRAINED}
    ckpts.update({name: shared_checkpoint(name) for name in SHARED})
    out = {}
    for name, ckpt in ckpts.items():
        tag = (ckpt / "latest").read_text().strip()
        out[name] = Source(name, ckpt, tag, tmp / name / "ds", SPECS.get(name))
    ds_to_universal_many([(s.ckpt / s.tag, s.ds_folder) for s in out.values()])
    return out
