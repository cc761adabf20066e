"""bench/run.py and its helpers: the measurements are taken, outputs are checked, and the
watchdog stops a process that grows past its limit. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import forge as F  # noqa: E402
from bench._check import check_output  # noqa: E402
from bench._iolimit import drop_cache, fp32_ranges, measure_limit, residency, warm_cache  # noqa: E402
from bench._measure import run_measured  # noqa: E402


def test_watchdog_kills_a_growing_tree() -> None:
    grow = "import time\nb = [bytearray(50 << 20) for _ in range(12)]\nfor x in b: x[::4096] = b'x' * len(x[::4096])\ntime.sleep(30)"
    m = run_measured(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grow!r}])"],
        limit_bytes=200 * 10**6,
    )  # fmt: skip
    assert m.killed is not None and "anonymous memory" in m.killed
    assert m.peak_anon_bytes > 200 * 10**6 and m.peak_procs >= 2
    assert m.wall_s < 25


def test_measured_io_counts_the_whole_tree(tmp_path: Path) -> None:
    data = tmp_path / "d.bin"
    data.write_bytes(b"\x01" * 3_000_000)
    code = f"import subprocess; subprocess.run(['cat', {str(data)!r}], stdout=subprocess.DEVNULL)"
    m = run_measured([sys.executable, "-c", code])
    assert m.returncode == 0 and m.rchar >= 3_000_000 and m.cpu_s > 0


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, F.ForgeInfo]:
    dest = tmp_path_factory.mktemp("h") / "ckpt"
    shapes = F.transformer_shapes(vocab=501, width=64, layers=2, tied=False)
    return dest, F.forge_checkpoint(
        dest, shapes=shapes, stage=3, world_size=4, tied=False, seed=3, threads=1
    )


def test_limit_and_cache_control(forged: tuple[Path, F.ForgeInfo], tmp_path: Path) -> None:
    ckpt, info = forged
    ranges, fp32 = fp32_ranges(str(ckpt))
    assert fp32 == info.fp32_bytes and sum(n for _, _, n in ranges) == fp32
    files = [f["path"] for f in info.files]
    warm_cache(files)
    drop_cache(files)
    res = residency(files)
    assert res is None or res < fp32  # evicted (fincore may be missing)
    for overlapped in (False, True):
        r = measure_limit(ranges, str(tmp_path / "o"), 100_000, overlapped=overlapped)
        assert r["bytes_read"] == fp32 and r["total_s"] > 0
    assert list((tmp_path / "o").iterdir()) == []


def test_check_output_finds_a_wrong_element(
    forged: tuple[Path, F.ForgeInfo], tmp_path: Path
) -> None:
    from zerosafe.config import ConvertOptions
    from zerosafe.driver import convert_checkpoint

    ckpt, info = forged
    out = tmp_path / "out"
    convert_checkpoint(str(ckpt), str(out), ConvertOptions(dtype="bf16", direct=True))
    kw = dict(params=info.params, buffers=info.buffers, seed=info.seed, out_dtype="bf16")
    good = check_output(str(out), **kw)  # type: ignore[arg-type]
    assert good["ok"] and good["elements"] == sum(
        int(__import__("math").prod(s))
        for s in [*info.params.values(), *(b[0] for b in info.buffers.values())]
    )
    assert check_output(str(out), mode="sample", **kw)["ok"]  # type: ignore[arg-type]
    assert not check_output(str(out), **{**kw, "out_dtype": "fp32"})["ok"]  # type: ignore[arg-type]
    # flip one element of a tensor in the middle of the file
    path = out / "model.safetensors"
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8 : 8 + n])["layers.1.mlp.up_proj.weight"]
    raw[8 + n + entry["data_offsets"][0] + 1001] ^= 0x40
    path.write_bytes(bytes(raw))
    bad = check_output(str(out), **kw)  # type: ignore[arg-type]
    assert not bad["ok"] and "layers.1.mlp.up_proj.weight" in bad["problems"][0]


@pytest.mark.slow
def test_run_tiny_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--size", "tiny", "--params", "3M",
         "--work-dir", str(tmp_path / "w"), "--results", str(tmp_path / "r"), "--settle", "0",
         "--kinds", "io-limit,zerosafe-direct,zerosafe-staged,deepspeed,baseline",
         "--cache", "warm,cold", "--clean"],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "r" / "tiny.json").read_text())
    tools = {(r["tool"], r["cache"]) for r in result["summary"]}
    for cache in ("warm", "cold"):
        assert {
            ("io-limit serial", cache),
            ("zerosafe-direct", cache),
            ("deepspeed", cache),
        } <= tools
    for row in result["summary"]:
        if not row["tool"].startswith("io-limit"):
            assert row["ok"], row
            assert row["peak_rss_bytes"] > 0 and row["checked"] == ["full ok"]
    assert "speed/limit" in result["table"]
    assert not (tmp_path / "w" / "ckpt-3M-z3-ws8").exists()  # --clean
