"""Helpers shared by tests: load an output folder, compare tensors byte for byte, run the
command in a child process, stop a conversion before it publishes and damage a file in
place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def load_output(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """All tensors of an output folder, and its zerosafe manifest ({} if none)."""
    index = out / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(out / f))
        assert not set(part) & set(tensors), f"tensor stored twice: {set(part) & set(tensors)}"
        tensors.update(part)
    manifest_path = out / "zerosafe-manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    return tensors, manifest


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN and -0.0 compare by bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def assert_torch_cast(got: torch.Tensor, src: torch.Tensor, out_dtype: torch.dtype) -> None:
    """`got` is `src.to(out_dtype)` bit for bit at every value but a NaN, which is a NaN of the
    same sign (its bits are not torch's: `zerosafe.cast`)."""
    want = src.to(out_dtype)
    nan = torch.isnan(src)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert bool(torch.isnan(got[nan]).all())
    assert torch.equal(torch.signbit(got[nan]), torch.signbit(src[nan]))


def upcast(t: torch.Tensor) -> torch.Tensor:
    """The exact fp32 value of a floating tensor; other dtypes unchanged."""
    return t.to(torch.float32) if t.is_floating_point() else t


REPO = Path(__file__).resolve().parents[1]


def zerosafe_child(*args: object, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """`zerosafe ARGS` in a child process: a command that hangs (a FIFO opened for reading)
    fails the test at `timeout_s` (`subprocess.TimeoutExpired`) instead of blocking it."""
    return subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", *map(str, args)],
        capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
    )  # fmt: skip


def assert_refused_in_one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The child exited 2 with one `zerosafe: error:` line holding every needle; the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    line = proc.stderr.strip()
    assert "\n" not in line and line.startswith("zerosafe: error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in line, line
    return line


def kill_before_publish(env: dict[str, str], *convert_args: str) -> None:
    """Run `zerosafe convert` until every shard is verified, then SIGKILL it as it starts to
    publish (in-process driver or flow alike: both call `publish_job`), leaving the verified
    shards pending with their unit records or cached results."""
    script = (
        "import os, signal, sys\n"
        "from zerosafe_app.cli import main\n"
        "import zerosafe.run.local, zerosafe_app.tasks.publish\n"
        "def die(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "zerosafe.run.local.publish_job = zerosafe_app.tasks.publish.publish_job = die\n"
        "sys.exit(main(['convert', *sys.argv[1:]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *convert_args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def zero_a_block_in_place(path: Path) -> None:
    """Zero the last 4 KiB of `path` (a shard's tensor data), keeping its size and mtime: a
    crash's zero-filled page or bit rot, which neither size nor version sees."""
    stat = path.stat()
    raw = bytearray(path.read_bytes())
    assert any(raw[-4096:]), "the block must hold data to damage"
    raw[-4096:] = bytes(4096)
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
