"""The restricted unpickler's DTensor entries refuse what torch.save never writes for a DTensor:
another class rebuilt as a wrapper subclass, a DTensor without its local shard or spec, a
layout other than strided. The pickles are made with torch.save of objects whose `__reduce__`
names the same globals a real DTensor's pickle does (the real files: test_verl.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._tensor
import torch._utils
import torch.serialization
from torch.distributed.tensor import DTensor

from zerosafe.errors import CheckpointFormatError, UnsafePickleError
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage


class _Layout:
    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Any:
        return (torch.serialization._get_layout, (self.name,))


class _Wrapper:
    """Pickles as `_rebuild_from_type_v2(_rebuild_wrapper_subclass, cls, args, state)`."""

    def __init__(self, cls: type, state: Any, layout: str = "torch.strided") -> None:
        self.cls, self.state, self.layout = cls, state, layout

    def __reduce__(self) -> Any:
        args = (self.cls, torch.float32, (2,), (1,), 0, _Layout(self.layout), "cpu", False)
        return (
            torch._tensor._rebuild_from_type_v2,
            (torch._utils._rebuild_wrapper_subclass, self.cls, args, self.state),
        )


def _load(tmp_path: Path, obj: Any) -> Any:
    path = tmp_path / "x.pt"
    torch.save({"w": obj}, path)
    archive = TorchZipFile(Storage().open_source(str(path)))
    try:
        return archive.load()
    finally:
        archive.source.close()


def test_only_dtensor_is_rebuilt_as_a_wrapper_subclass(tmp_path: Path) -> None:
    with pytest.raises(UnsafePickleError, match="wrapper tensor subclass .* not supported"):
        _load(tmp_path, _Wrapper(torch.Tensor, (None, {"_local_tensor": torch.zeros(2)})))


def test_a_dtensor_without_its_spec_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="without the `_local_tensor` and `_spec`"):
        _load(tmp_path, _Wrapper(DTensor, (None, {"_local_tensor": torch.zeros(2)})))


def test_a_layout_other_than_strided_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafePickleError, match="layout 'torch.sparse_coo'"):
        _load(tmp_path, _Wrapper(DTensor, (None, {}), layout="torch.sparse_coo"))
