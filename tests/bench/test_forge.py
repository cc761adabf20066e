"""bench/forge: synthetic DeepSpeed ZeRO checkpoints, checked against the real fixtures'
structure, DeepSpeed's own converter, zerosafe, zipfile/torch readers, and for bounded memory."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import forge as F  # noqa: E402
from zerosafe.formats.crc import crc32_combine, crc32_zeros  # noqa: E402

FIXTURES = Path(
    os.environ.get("ZEROSAFE_SHARED_FIXTURES", REPO.parent / "shared" / "fixtures" / "deepspeed")
)

SMALL = F.transformer_shapes(vocab=1001, width=64, layers=2)  # ~155K params, odd sizes
FROZEN = ["layers.0.attn.k_proj.bias", "layers.1.mlp.up_proj.weight"]


def forge(dest: Path, **kw: Any) -> F.ForgeInfo:
    args: dict[str, Any] = dict(
        shapes=SMALL, stage=3, world_size=3, dtype="bf16", seed=7, threads=2
    )
    args.update(kw)
    return F.forge_checkpoint(dest, **args)


def write_spec(info: F.ForgeInfo, path: Path) -> Path:
    path.write_text(json.dumps(dataclasses.asdict(info)))
    return path


# ------------------------------------------------------------------------------------------------
# values and CRC algebra
# ------------------------------------------------------------------------------------------------


def test_values_are_deterministic_varied_and_addressable() -> None:
    full = F.expected_fp32("a.weight", 0, 3_000_000, seed=1)
    assert np.array_equal(
        F.expected_fp32("a.weight", 1_234_567, 1000, seed=1), full[1_234_567:1_235_567]
    )
    assert (full < 0).any() and (full > 0).any() and np.isfinite(full).all()
    assert len(np.unique(full[:100_000])) > 99_000
    assert not np.array_equal(F.expected_fp32("b.weight", 0, 1000, seed=1), full[:1000])
    assert not np.array_equal(F.expected_fp32("a.weight", 0, 1000, seed=2), full[:1000])
    t = torch.from_numpy(full.copy())
    assert np.array_equal(
        F.expected_16bit("a.weight", 0, 3_000_000, "bf16", seed=1),
        t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
    )
    assert np.array_equal(
        F.expected_16bit("a.weight", 0, 3_000_000, "fp16", seed=1),
        t.to(torch.float16).view(torch.int16).numpy().view(np.uint16),
    )
    ties = (full.view(np.uint32) & 0xFFFF) == 0x8000  # round-half-even cases for bf16 are present
    assert ties.sum() > 10


def test_crc_algebra_matches_zlib() -> None:
    for n in (0, 1, 3, 64, 4097, 1 << 20):
        assert crc32_zeros(n) == zlib.crc32(bytes(n))
        assert crc32_zeros(n, 0xDEADBEEF) == zlib.crc32(bytes(n), 0xDEADBEEF)
    a, b = os.urandom(5000), os.urandom(333)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_transformer_shapes_sizes() -> None:
    for target in ("125M", "500M", "7B"):
        shapes = F.transformer_shapes(target)
        n = sum(math.prod(s) for _, s in shapes)
        assert abs(n - F.parse_count(target)) / F.parse_count(target) < 0.15, (target, n)
        assert shapes[0][0] == "embed.weight" and "lm_head.weight" not in dict(shapes)
        assert any(math.prod(s) % 2 for _, s in shapes)  # odd sizes present


# ------------------------------------------------------------------------------------------------
# structure: forge a copy of each real fixture's model and compare the decoded pickles and records
# ------------------------------------------------------------------------------------------------

NET = {
    "emb.weight": (101, 48),
    "l1.weight": (75, 48),
    "l1.bias": (75,),
    "ln.weight": (75,),
    "ln.bias": (75,),
    "l2.weight": (48, 75),
    "l2.bias": (48,),
    "adapter.0.weight": (11, 48),
    "adapter.0.bias": (11,),
    "adapter.2.weight": (48, 11),
    "adapter.2.bias": (48,),
    "norm_f.weight": (48,),
    "norm_f.bias": (48,),
    "head.weight": (101, 48),
}


class _Obj:
    """Inert stand-in for any global the pickle names."""

    def __new__(cls, *args: Any) -> Any:
        o = object.__new__(cls)
        o.args, o.state, o.items = args, None, []
        return o

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, k: Any, v: Any) -> None:
        self.items.append((k, v))


class _Inert(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return type(name, (_Obj,), {"qual": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:
        return ("PID",) + tuple(pid)


def _norm(o: Any) -> Any:
    if isinstance(o, type) and issubclass(o, _Obj):
        return "<" + o.qual + ">"  # type: ignore[attr-defined]
    if isinstance(o, _Obj):
        return {
            "<call>": type(o).qual,
            "args": _norm(o.args),
            "state": _norm(o.state),  # type: ignore[attr-defined]
            "items": [(k, _norm(v)) for k, v in o.items],
        }
    if isinstance(o, dict):
        return {k: _norm(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return type(o)(_norm(v) for v in o)
    return o


def _decode(path: Path) -> tuple[Any, list[tuple[str, int]]]:
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        arch = names[0].split("/")[0]
        obj = _norm(_Inert(io.BytesIO(z.read(arch + "/data.pkl"))).load())
        records = [
            (n, z.getinfo(n).file_size)
            for n in names
            if not n.endswith(("data.pkl", "serialization_id"))
        ]
    return obj, records


def _scrub(o: Any) -> Any:
    """Drop what depends on the training run rather than on the format."""
    if isinstance(o, dict):
        out = {}
        for k, v in o.items():
            if k in ("skipped_steps", "overflow"):
                continue
            if k == "loss_scaler":  # its values are training history: keep the class and keys
                v = {"<call>": v["<call>"], "keys": sorted(v["state"])}
            if k == "state" and isinstance(v, dict) and "_metadata" in v:  # module prefixes
                v = {**v, "_metadata": None}
            out[k] = _scrub(v)
        return out
    if isinstance(o, (list, tuple)):
        return type(o)(_scrub(v) for v in o)
    return o


MIRRORED = (
    [
        d.name
        for d in sorted(FIXTURES.glob("z*"))
        if (d / "checkpoint").is_dir()
        and "roundrobin" not in d.name
        and "bf16optimizer" not in d.name
    ]
    if FIXTURES.is_dir()
    else []
)


@pytest.mark.skipif(not MIRRORED, reason="shared fixtures absent")
@pytest.mark.parametrize("fixture", MIRRORED)
def test_structure_matches_real_deepspeed_checkpoint(fixture: str, tmp_path: Path) -> None:
    m = json.loads((FIXTURES / fixture / "manifest.json").read_text())
    model = m["model"]
    aliases = model["shared_params_recorded_by_deepspeed"]
    names = [n for n, _ in model["named_parameters_including_tied"] if n not in aliases]
    groups = model["optimizer_param_groups"]
    cfg = m["ds_config"]
    info = F.forge_checkpoint(
        tmp_path / "ckpt",
        shapes=[(n, NET[n]) for n in names],
        stage=m["stage"],
        world_size=m["world_size"],
        dtype=m["precision"],
        tag=m["latest"],
        sub_group_numel=cfg["zero_optimization"].get("sub_group_size"),
        tied=aliases or False,
        frozen=model["frozen_params"],
        groups=len(groups),
        buffers=[("fbuf", (7,), "float32"), ("ibuf", (5,), "int64")],
        ds_config=cfg,
        micro_batch=cfg["train_micro_batch_size_per_gpu"],
        lr=0.03,
        betas=(0.9, 0.99),
        weight_decay=tuple(g["weight_decay"] for g in groups) + (0.0,) * (2 - len(groups)),
        threads=1,
    )
    assert info.param_groups == [[n for n in g["params"] if n not in aliases] for g in groups]
    real_dir = FIXTURES / fixture / "checkpoint" / m["latest"]
    ours_dir = tmp_path / "ckpt" / m["latest"]
    assert sorted(p.name for p in ours_dir.iterdir()) == sorted(
        p.name for p in real_dir.glob("*.pt")
    )
    assert (tmp_path / "ckpt" / "latest").read_bytes() == (
        FIXTURES / fixture / "checkpoint" / "latest"
    ).read_bytes()
    for real in sorted(real_dir.glob("*.pt")):
        real_obj, real_records = _decode(real)
        ours_obj, ours_records = _decode(ours_dir / real.name)
        assert ours_records == real_records, real.name  # same records, order, storage sizes
        assert _scrub(ours_obj) == _scrub(real_obj), real.name
        if "model_states" in real.name:
            real_meta = list(real_obj["module"]["state"]["_metadata"]["items"])
            ours_meta = list(ours_obj["module"]["state"]["_metadata"]["items"])
            assert [k for k, _ in ours_meta] == [k for k, _ in real_meta if k in dict(ours_meta)]


def test_zip_layout_like_torch(tmp_path: Path) -> None:
    """Records stored, data 64-byte aligned, flag 0x0808 with data descriptors, ZIP64 end records."""
    forge(tmp_path / "c", stage=2)
    path = tmp_path / "c" / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        for info in z.infolist():
            assert info.compress_type == zipfile.ZIP_STORED and info.flag_bits == 0x0808
            hdr = raw[info.header_offset : info.header_offset + 30]
            name_len, extra_len = struct.unpack("<HH", hdr[26:30])
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0
    assert raw[-22 - 20 - 56 : -22 - 20 - 52] == b"PK\x06\x06" and raw[-22:-18] == b"PK\x05\x06"


# ------------------------------------------------------------------------------------------------
# DeepSpeed's own converter reconstructs exactly what the forge intended
# ------------------------------------------------------------------------------------------------


def test_deepspeed_converter_is_bit_exact(tmp_path: Path) -> None:
    cases = {
        "z2": dict(stage=2, tied=True, frozen=FROZEN),
        "z3": dict(stage=3, tied=True, frozen=FROZEN, sub_group_numel=20_000),
        "z3-zip64": dict(
            stage=3, tied=True, sub_group_numel=30_000, zip64_threshold=4096, moments="zeros"
        ),
        "z1-fp16-ws4": dict(
            stage=1,
            world_size=4,
            dtype="fp16",
            tied=False,
            groups=1,
            shapes=F.transformer_shapes(vocab=333, width=32, layers=1, tied=False),
        ),
        "z3-fp32-ws2": dict(
            stage=3, world_size=2, dtype="fp32", frozen=FROZEN, sub_group_numel=5_000
        ),
    }
    argv = [sys.executable, str(Path(__file__).with_name("_ds_oracle.py")), str(REPO)]
    for name, kw in cases.items():
        info = forge(tmp_path / name, **kw)
        argv += [str(tmp_path / name), str(write_spec(info, tmp_path / f"{name}.json"))]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    results = [
        json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert proc.returncode == 0 and len(results) == len(cases), (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    for r in results:
        assert r["problems"] == [], r
        assert r["files_loaded"] >= 3 and r["tensors"] > 10


# ------------------------------------------------------------------------------------------------
# zerosafe converts forged checkpoints bit-exactly
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_zerosafe_converts_bit_exact(stage: int, tmp_path: Path) -> None:
    from safetensors import safe_open

    from zerosafe.config import ConvertOptions
    from zerosafe.driver import convert_checkpoint

    info = forge(tmp_path / "ckpt", stage=stage, frozen=FROZEN, sub_group_numel=25_000)
    out = tmp_path / "out"
    convert_checkpoint(str(tmp_path / "ckpt"), str(out), ConvertOptions(direct=True))
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118
                got[k] = st.get_tensor(k)
    # the tied alias is recorded (metadata), not stored
    assert set(got) == set(info.params) | set(info.buffers)
    for name, shape in info.params.items():
        t = got[name]
        assert t.dtype == torch.float32 and tuple(t.shape) == shape, name
        want = F.expected_fp32(name, 0, math.prod(shape), info.seed)
        if name in info.frozen:  # only the bf16 copy exists: zerosafe upcasts it exactly
            want = (
                F.expected_16bit(name, 0, want.size, "bf16", info.seed).astype(np.uint32) << 16
            ).view(np.float32)
        assert np.array_equal(t.numpy().ravel().view(np.uint32), want.view(np.uint32)), name
    for name, (shape, dt) in info.buffers.items():
        assert np.array_equal(got[name].numpy(), F.expected_buffer(name, shape, dt, info.seed)), (
            name
        )


# ------------------------------------------------------------------------------------------------
# zip integrity, sparse moments, ZIP64
# ------------------------------------------------------------------------------------------------


def test_crcs_and_sparse_moments(tmp_path: Path) -> None:
    sparse = forge(tmp_path / "sparse", stage=2, moments="sparse")
    dense = forge(tmp_path / "dense", stage=2, moments="zeros")
    for a, b in zip(sparse.files, dense.files, strict=True):
        for path in (a["path"], b["path"]):
            with zipfile.ZipFile(path) as z:
                assert z.testzip() is None, path
        assert a["apparent_bytes"] == b["apparent_bytes"]
        assert Path(a["path"]).read_bytes() == Path(b["path"]).read_bytes()  # holes read as zeros
    optim = [f for f in sparse.files if "optim" in f["path"]]
    # the moments are 2/3 of an optimizer file, and take no disk
    assert all(f["written_bytes"] < 0.45 * f["apparent_bytes"] for f in optim)


def test_zip64_records_read_by_zipfile_and_torch(tmp_path: Path) -> None:
    info = forge(tmp_path / "c", stage=3, zip64_threshold=1000, frozen=FROZEN)
    for f in info.files:
        raw = Path(f["path"]).read_bytes()
        with zipfile.ZipFile(f["path"]) as z:
            assert z.testzip() is None
            big = [i for i in z.infolist() if i.file_size >= 1000 or i.header_offset >= 1000]
            assert big
            for i in big:  # the central directory entry carries a ZIP64 extra field
                assert struct.unpack("<H", i.extra[:2])[0] == 1, i.filename
            for i in z.infolist():  # and zip64-sized records say so in their local header too
                lh = raw[i.header_offset : i.header_offset + 30]
                assert struct.unpack("<I", lh[18:22])[0] == (
                    0xFFFFFFFF if i.file_size >= 1000 else 0
                )
    # ZeRO-3 model states name only torch's own globals: even the restricted loader takes them
    ms = torch.load(info.files[0]["path"], map_location="cpu", weights_only=True)
    frag = ms["frozen_param_fragments"][FROZEN[1]]
    n = math.prod(info.params[FROZEN[1]])
    c = -(-n // 3)
    want = F.expected_16bit(FROZEN[1], 0, c, "bf16", info.seed)
    assert np.array_equal(frag.view(torch.int16).numpy().view(np.uint16), want)
    assert ms["buffer_names"] == list(info.buffers) and ms["shared_params"] == info.aliases


def test_zerosafe_reads_zip64_records(tmp_path: Path) -> None:
    from zerosafe.config import ConvertOptions
    from zerosafe.driver import convert_checkpoint

    info = forge(tmp_path / "ckpt", stage=2, zip64_threshold=2000)
    convert_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"), ConvertOptions(direct=True))
    from safetensors.numpy import load_file

    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    name = "layers.1.mlp.down_proj.weight"
    assert np.array_equal(
        got[name].ravel(), F.expected_fp32(name, 0, math.prod(info.params[name]), info.seed)
    )


# ------------------------------------------------------------------------------------------------
# memory and the command line
# ------------------------------------------------------------------------------------------------

_MEM_SCRIPT = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from bench import forge as F
def hwm():  # this process's own peak RSS (VmHWM), KiB
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
base, base_hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, hwm()
shapes = F.transformer_shapes("80M", vocab=16001, width=512)
info = F.forge_checkpoint(sys.argv[2], shapes=shapes, stage=2, world_size=2, dtype="bf16",
                          chunk_bytes=4 << 20, threads=2)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"base_kib": base, "peak_kib": peak, "base_hwm_kib": base_hwm, "peak_hwm_kib": hwm(), "written": info.written_bytes,
                  "apparent": info.apparent_bytes, "largest": max(f["written_bytes"] for f in info.files),
                  "seconds": info.seconds,
                  "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed"))}))
"""


def test_memory_stays_bounded(tmp_path: Path) -> None:
    # Through sh, which forks: a child exec'd straight from pytest inherits pytest's ru_maxrss
    # (Linux keeps the high-water mark across exec), which would hide the forge's own peak.
    proc = subprocess.run(
        [
            "/bin/sh",
            "-c",
            '"$0" -c "$1" "$2" "$3"; exit $?',
            sys.executable,
            _MEM_SCRIPT,
            str(REPO),
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    peak, base = r["peak_kib"] * 1024, r["base_kib"] * 1024
    print(
        f"\nforge memory: baseline RSS {base / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB; wrote "
        f"{r['written'] / 1e6:.0f} MB ({r['apparent'] / 1e6:.0f} MB apparent, largest file "
        f"{r['largest'] / 1e6:.0f} MB written) in {r['seconds']:.2f} s"
    )
    assert r["written"] > 300e6
    assert r["modules"] == []  # the forge needs (and imports, or fakes) neither torch nor DeepSpeed
    assert peak - base < 64 * 2**20  # buffers: (threads + 2) x 4 MiB chunks, plus block scratch
    assert peak < r["largest"] / 2  # the largest file holds a 160 MB fp32 partition
    assert r["peak_hwm_kib"] * 1024 < r["largest"] / 2


@pytest.mark.parametrize(
    "entry", [["-m", "bench.forge"], [str(REPO / "bench" / "forge")]], ids=["module", "folder"]
)
def test_cli(tmp_path: Path, entry: list[str]) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            *entry,
            str(tmp_path / "c"),
            "--params",
            "3M",
            "--stage",
            "3",
            "--world-size",
            "5",
            "--dtype",
            "bf16",
            "--sub-group",
            "200k",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "GB/s" in proc.stdout and "peak RSS" in proc.stdout
    assert (tmp_path / "c" / "latest").read_text() == "global_step1"
    assert len(list((tmp_path / "c" / "global_step1").glob("*.pt"))) == 10
