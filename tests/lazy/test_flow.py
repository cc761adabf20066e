"""The Prefect flow `lazify` (what the `lazify/default` deployment runs), in process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lazy.test_lazify import MODEL, OPTIM, _make_checkpoint
from zerosafe import lazy_torch_load
from zerosafe.errors import ConfigError


@pytest.mark.slow
def test_flow_writes_siblings_then_finds_them_current(prefect_server: None, tmp_path: Path) -> None:
    from flows.lazify import lazify  # the deployment's entrypoint

    tag_dir = _make_checkpoint(tmp_path / "ckpt", seed=8)
    result = lazify(checkpoint=str(tmp_path / "ckpt"), memory="80MiB", parallel=2)
    assert (result["written"], result["current"]) == (3, 0)
    assert {Path(f["sibling"]).name for f in result["files"]} == {
        n + ".safetensors" for n in [MODEL, *OPTIM]
    }
    again = lazify(checkpoint=str(tag_dir))  # a tag folder works too
    assert (again["written"], again["current"]) == (0, 3)
    with lazy_torch_load() as loads:
        torch.load(tag_dir / OPTIM[0], map_location="cpu")
    assert loads.loaded == [str(tag_dir / OPTIM[0])]
    with pytest.raises(ConfigError, match="credentials may not be flow parameters"):
        lazify(checkpoint=str(tag_dir), storage_options={"secret": "x"})
