"""zerosafe.cast: numpy's casts give torch's values, and a bfloat16 conversion never imports torch."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from tests.conftest import SAMPLE_CKPT
from zerosafe.cast import NUMPY_CASTS, cast_bytes, needs_torch

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _torch_cast(raw: bytes, src: str, out: str) -> bytes:
    t = torch.frombuffer(bytearray(raw), dtype=_TORCH[src]).to(_TORCH[out])
    return t.view(torch.uint8).numpy().tobytes()


def _float32_patterns() -> np.ndarray:
    """Every bfloat16 value's float32 (each upper half) with the low halves that decide its
    rounding: exact, just above, just below and at the tie, the tie's neighbours, all ones."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF, 0x1234], dtype=np.uint32)
    return (high[:, None] | lows[None, :]).reshape(-1)


def test_float32_to_bfloat16_rounds_as_torch_does() -> None:
    bits = _float32_patterns()
    ours = np.frombuffer(cast_bytes(bits.tobytes(), "float32", "bfloat16"), np.uint16)
    ref = np.frombuffer(_torch_cast(bits.tobytes(), "float32", "bfloat16"), np.uint16)
    nan = np.isnan(bits.view(np.float32))
    assert nan.sum() > 1000 and (~nan).sum() > 500_000
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    # NaN stays NaN, quiet, with its sign (torch's own bits vary with where the NaN falls)
    assert np.all((ours[nan] & 0x7FFF) == 0x7FC0)
    np.testing.assert_array_equal(ours[nan] >> 15, (bits[nan] >> 31).astype(np.uint16))


@pytest.mark.parametrize("src", ["bfloat16", "float16"])
def test_widening_to_float32_gives_torch_values_for_every_value(src: str) -> None:
    raw = np.arange(1 << 16, dtype=np.uint16).tobytes()
    assert (src, "float32") in NUMPY_CASTS
    ours = np.frombuffer(cast_bytes(raw, src, "float32"), np.uint32)
    ref = np.frombuffer(_torch_cast(raw, src, "float32"), np.uint32)
    nan = np.isnan(ref.view(np.float32))
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    # a signalling float16 NaN stays signalling in numpy, torch quiets it: NaN either way
    assert np.isnan(ours[nan].view(np.float32)).all()
    np.testing.assert_array_equal(ours[nan] >> 31, ref[nan] >> 31)


def test_other_pairs_go_through_torch() -> None:
    assert needs_torch("float32", "float16") and needs_torch("bfloat16", "float16")
    assert not needs_torch("float32", "bfloat16") and not needs_torch("bfloat16", "bfloat16")
    raw = np.array([1.0, 65504.0, 1e5, -(2.0**-25), 3.0e-8], np.float32).tobytes()
    assert cast_bytes(raw, "float32", "float16") == _torch_cast(raw, "float32", "float16")


@pytest.mark.parametrize(("dtype", "imports_torch"), [("bf16", False), ("fp16", True)])
def test_a_conversion_imports_torch_only_for_float16(dtype: str, imports_torch: bool) -> None:
    """The whole command, in a fresh interpreter: to bfloat16 (merge, verify, publish) torch's
    import is never paid; to float16 the cast needs it."""
    code = (
        "import sys\n"
        "from zerosafe_app.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print('exit', code, 'torch', 'torch' in sys.modules)\n"
    )
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run(
            [sys.executable, "-c", code, "convert", str(SAMPLE_CKPT), f"{out}/model",
             "--dtype", dtype, "--via", "local", "--quiet"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-4:] == ["exit", "0", "torch", str(imports_torch)]


def test_serial_torch_waits_for_the_cast_that_imports_torch() -> None:
    code = (
        "import sys\n"
        "from zerosafe.cast import cast_bytes, serial_torch\n"
        "serial_torch()\n"
        "before = 'torch' in sys.modules\n"
        "cast_bytes(bytes(8), 'float32', 'float16')\n"
        "import torch\n"
        "print(before, torch.get_num_threads())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.split() == ["False", "1"]
