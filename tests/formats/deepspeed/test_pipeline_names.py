"""How a pipeline checkpoint's layer files are named (`_name_layer_files`), on plain records.

A layer file holds a layer's own `state_dict()` (`weight`, `up.bias`); its module is `str(i)`,
or `tied_modules.<key>` for a `TiedLayerSpec`, which the file does not say. The real
checkpoints of `test_pipeline_parallel.py` cover the common cases; these cover the rest.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from zerosafe.errors import LayoutMismatchError, UnsupportedCheckpointError
from zerosafe.formats.deepspeed.checkpoint import LoadedFile
from zerosafe.formats.deepspeed.pipeline import _name_layer_files
from zerosafe.formats.torch_pickle import StorageRef, TensorRecord
from zerosafe.io.storage import FileIdentity


def _record(*shape: int) -> TensorRecord:
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # row-major
    return TensorRecord(
        storage=StorageRef(key="0", dtype="float32", numel=math.prod(shape), location="cpu"),
        storage_offset=0, shape=shape, stride=stride, dtype="float32",
    )  # fmt: skip


def _layer(idx: int, **tensors: tuple[int, ...]) -> LoadedFile:
    """A layer file's loaded pickle (`up__weight` stands for `up.weight`)."""
    url = f"mem://tag/layer_{idx:02d}-model_states.pt"
    obj: dict[str, Any] = {k.replace("__", "."): _record(*shape) for k, shape in tensors.items()}
    identity = FileIdentity(url=url, size_bytes=0, version="0")
    return LoadedFile(url=url, role="layer", rank=0, identity=identity, zip=None, obj=obj)  # type: ignore[arg-type]


def _names(
    layers: dict[int, LoadedFile],
    shapes: dict[str, tuple[int, ...]],
    buffers: tuple[str, ...] | set[str] = (),
) -> dict[int, list[str]]:
    known = set(shapes) | set(buffers)
    named = _name_layer_files(layers, known, shapes)
    return {idx: [t.name for t in ts] for idx, ts in named.items()}


def test_plain_layer_and_its_frozen_params() -> None:
    shapes = {"2.up.weight": (4, 3)}
    got = _names({2: _layer(2, up__weight=(4, 3), up__bias=(4,), scale=(5,))}, shapes, {"2.scale"})
    assert got == {2: ["2.up.weight", "2.up.bias", "2.scale"]}  # up.bias: frozen


def test_tied_module_by_its_trained_names() -> None:
    shapes = {"tied_modules.embed.weight": (9, 3), "3.weight": (3,)}
    layers = {0: _layer(0, weight=(9, 3), temperature=(2,)), 3: _layer(3, weight=(3,))}
    got = _names(layers, shapes, {"tied_modules.embed.temperature"})
    assert got == {
        0: ["tied_modules.embed.weight", "tied_modules.embed.temperature"],
        3: ["3.weight"],
    }


def test_a_layer_of_frozen_params_only_keeps_its_index() -> None:
    got = _names({5: _layer(5, weight=(7, 3))}, {"tied_modules.embed.weight": (9, 3)})
    assert got == {5: ["5.weight"]}  # the tied weight's shape does not fit


def test_two_tied_modules_told_apart_by_shape_or_refused() -> None:
    shapes = {"tied_modules.embed.weight": (9, 3), "tied_modules.pos.weight": (6, 3)}
    assert _names({7: _layer(7, weight=(6, 3))}, shapes) == {7: ["tied_modules.pos.weight"]}
    same = {"tied_modules.embed.weight": (9, 3), "tied_modules.pos.weight": (9, 3)}
    with pytest.raises(UnsupportedCheckpointError, match="fit the tied modules"):
        _names({7: _layer(7, weight=(9, 3))}, same)


def test_layer_file_of_another_model_is_refused() -> None:
    with pytest.raises(LayoutMismatchError, match="'2.up.weight' has shape \\[4, 4\\]"):
        _names({2: _layer(2, up__weight=(4, 4))}, {"2.up.weight": (4, 3)})
