"""Never exit 0 on wrong or unverified output (issue 16): each test failed before its fix.

Mixed saves in one tag, two jobs into one output, leftovers of a failed run, stale no-ops,
`verify --against` another checkpoint, cached reads of a fixed file, path spellings, and the
one-line errors for bad outputs, markers, `latest` and tags. Real checkpoints: the shipped
sample and the shared DeepSpeed fixtures.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, SHARED_FIXTURES
from tests.helpers import load_output, same_bytes
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import IntegrityError, LayoutMismatchError
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.lease import LeaseHeldError
from zerosafe.io.storage import Storage
from zerosafe_app.cli import main

TAG = "global_step2"
TWO_TAGS = SHARED_FIXTURES / "z3-bf16-ws3-tied-frozen-2tags-subgroups" / "checkpoint"
needs_two_tags = pytest.mark.skipif(not TWO_TAGS.is_dir(), reason="needs ../shared/fixtures")


def _optim(ckpt: Path, rank: int, tag: str = TAG) -> Path:
    return ckpt / tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    assert err.startswith("zerosafe: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def _model_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("model*")) if out.is_dir() else []


@pytest.fixture
def two_tags(tmp_path: Path) -> Path:
    dest = tmp_path / "ckpt"
    shutil.copytree(TWO_TAGS, dest)
    return dest


# -- 1. a tag folder that mixes saves -------------------------------------------------------------


@needs_two_tags
@pytest.mark.parametrize("which", ["both", "optim", "model"])
def test_a_tag_that_mixes_steps_is_refused_naming_the_odd_file(
    two_tags: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    names = {
        "optim": ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"],
        "model": ["zero_pp_rank_1_mp_rank_00_model_states.pt"],
    }
    for name in names.get(which, names["optim"] + names["model"]):
        shutil.copy2(two_tags / "global_step2" / name, two_tags / "global_step4" / name)
    out = tmp_path / "out"
    code, _, err = _run(capsys, "convert", "--via", "local", str(two_tags), str(out))
    err = _one_line_error(code, err)
    assert "different saves" in err and "rank_1_mp_rank_00" in err, err
    assert ("global_steps 2" in err) if which != "optim" else ("optimizer step count" in err)
    assert _model_files(out) == []
    with pytest.raises(LayoutMismatchError, match="different saves"):
        convert_checkpoint(str(two_tags), str(tmp_path / "out2"))
    # `inspect` refuses it too, before anything is planned
    code, _, err = _run(capsys, "inspect", str(two_tags))
    assert "different saves" in _one_line_error(code, err)


@pytest.mark.skipif(not SHARED_FIXTURES.is_dir(), reason="needs ../shared/fixtures")
@pytest.mark.parametrize(
    "which", ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
)
def test_zero2_model_states_from_another_step_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    """ZeRO-1/2 have one model states file, so it cannot disagree with other ranks; its
    16-bit copy of the weights must match the fp32 masters it was saved with."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(SHARED_FIXTURES / "z2-bf16-ws1-frozen-2tags" / "checkpoint", ckpt)
    shutil.copy2(ckpt / "global_step2" / which, ckpt / "global_step4" / which)
    code, _, err = _run(capsys, "convert", "--via", "local", str(ckpt), str(tmp_path / "out"))
    err = _one_line_error(code, err)
    assert "come from different saves" in err and "mp_rank_00_model_states.pt" in err, err
    assert _model_files(tmp_path / "out") == []


def test_the_files_of_one_save_agree(sample_ckpt: Path, tmp_path: Path) -> None:
    """Every shared fixture and the sample are one save each: the cross-check passes."""
    from zerosafe.formats.deepspeed.checkpoint import open_zero_checkpoint

    roots = [sample_ckpt] + sorted(p / "checkpoint" for p in SHARED_FIXTURES.glob("*"))
    for root in roots:
        if root.is_dir():
            open_zero_checkpoint(Storage(), str(root))


# -- 2. two jobs into one output ------------------------------------------------------------------


@contextlib.contextmanager
def _holding_output(out: Path) -> Iterator[subprocess.Popen[str]]:
    """Another live process converting into `out` (it holds the output's lease)."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from zerosafe.io.lease import destination_lease
        from zerosafe.io.storage import Storage
        with destination_lease(Storage(), {str(out)!r}, job="ckpt -> out (fp32)"):
            print("held", flush=True)
            time.sleep(120)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_job_into_a_held_output_is_refused_whatever_its_options(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with _holding_output(out) as holder:
        for extra in ([], ["--dtype", "bf16"], ["--max-shard-size", "10KB", "--overwrite"]):
            code, _, err = _run(
                capsys, "convert", "--via", "local", str(sample_ckpt), str(out), *extra
            )
            err = _one_line_error(code, err)
            assert "another conversion into this output folder is running" in err, err
            assert f"pid {holder.pid}" in err and "ckpt -> out (fp32)" in err
        with pytest.raises(LeaseHeldError):
            convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions(dtype="bf16"))
        assert _model_files(out) == []
    # the holder is gone (killed): its lease is stale and taken over
    assert convert_checkpoint(str(sample_ckpt), str(out)).status == "converted"
    assert not (out / ".zerosafe-lease.json").exists()


# -- 3. leftovers of a failed run ----------------------------------------------------------------


def _flip_fp32_bit(path: Path) -> None:
    zf = TorchZipFile(Storage().open_source(str(path)))
    group = zf.load()["optimizer_state_dict"]["fp32_flat_groups"][0]
    offset = zf.tensor_offset(group) + 8
    stat = path.stat()
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `cp -p` would leave it


@pytest.mark.parametrize("direct", [False, True])
def test_a_failed_check_leaves_nothing_that_looks_like_output(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], direct: bool
) -> None:
    good = _optim(sample_ckpt, 1).read_bytes()
    _flip_fp32_bit(_optim(sample_ckpt, 1))
    out = tmp_path / "out"
    with pytest.raises(IntegrityError):
        convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions(direct=direct))
    assert _model_files(out) == []
    (work,) = (out / ".zerosafe-work").iterdir()  # the plan stays; nothing read survives
    assert not (work / "intermediate").exists() and not list((work / "pending").iterdir())
    code, stdout, _ = _run(capsys, "verify", str(out))
    assert code == 1 and "incomplete conversion" in stdout
    # 6. the good file restored with the same size and mtime converts: nothing was cached
    stat = _optim(sample_ckpt, 1).stat()
    _optim(sample_ckpt, 1).write_bytes(good)
    os.utime(_optim(sample_ckpt, 1), ns=(stat.st_atime_ns, stat.st_mtime_ns))
    summary = convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions(direct=direct))
    assert summary.status == "converted"


def test_verify_calls_a_folder_with_work_files_and_no_marker_incomplete(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions(keep_work=True))
    (out / "zerosafe-complete.json").unlink()  # as if killed before the marker
    code, stdout, _ = _run(capsys, "verify", str(out))
    assert code == 1 and "incomplete conversion" in stdout, stdout
    shutil.rmtree(out / ".zerosafe-work")
    (out / "model.safetensors").unlink()
    (out / ".zerosafe-work" / "0123456789abcdef" / "pending").mkdir(parents=True)
    code, stdout, _ = _run(capsys, "verify", str(out))
    assert code == 1 and "incomplete conversion" in stdout, stdout


# -- 4. a stale no-op ------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["delete", "corrupt", "truncate", "index"])
def test_a_changed_output_is_repaired_not_called_complete(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    out = tmp_path / "out"
    args = ("convert", "--via", "local", str(sample_ckpt), str(out), "--max-shard-size", "12KB")
    assert _run(capsys, *args)[0] == 0
    before = {k: v.clone() for k, v in load_output(out)[0].items()}  # not a view of the file
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    victim = shards[1] if damage != "index" else out / "model.safetensors.index.json"
    stamps = {p.name: p.stat().st_mtime_ns for p in shards if p != victim}
    if damage in ("delete", "index"):
        victim.unlink()
    elif damage == "corrupt":
        raw = bytearray(victim.read_bytes())
        raw[-3] ^= 0xFF
        victim.write_bytes(bytes(raw))
    else:
        victim.write_bytes(victim.read_bytes()[:-100])
    code, stdout, _ = _run(capsys, *args)
    assert code == 0 and "nothing to do" not in stdout, stdout
    after, _ = load_output(out)
    assert before.keys() == after.keys()
    assert all(same_bytes(before[k], after[k]) for k in before)
    # only the changed shard was written again
    assert {p.name: p.stat().st_mtime_ns for p in shards if p != victim} == stamps
    assert _run(capsys, "verify", str(out), "--against", str(sample_ckpt))[0] == 0
    code, stdout, _ = _run(capsys, *args)
    assert code == 0 and "nothing to do" in stdout


def test_a_repairs_one_merge_is_its_run_and_the_kept_shards_take_no_place(
    sample_ckpt: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Merges learn their place in the run (`merge_streams`) from the merges that read: in a
    repair the one shard merged again is the whole run, and gets the idle task's core."""
    from zerosafe.run import schedule

    places: list[tuple[int, int, int]] = []
    real = schedule.merge_streams

    def merge_streams(position: int, total: int, at_once: int, options: ConvertOptions) -> int:
        places.append((position, total, at_once))
        return real(position, total, at_once, options)

    monkeypatch.setattr(schedule, "merge_streams", merge_streams)
    out = tmp_path / "out"
    args = ("convert", "--via", "local", str(sample_ckpt), str(out), "--max-shard-size", "12KB",
            "--parallel", "2")  # fmt: skip
    assert _run(capsys, *args)[0] == 0
    shards = sorted(out.glob("model-*.safetensors"))
    assert sorted(places) == [(p, len(shards), 2) for p in range(len(shards))]
    places.clear()
    shards[1].unlink()
    assert _run(capsys, *args)[0] == 0
    assert places == [(0, 1, 2)] and real(0, 1, 2, ConvertOptions()) == 2


# -- 5. verify --against another checkpoint --------------------------------------------------------


@needs_two_tags
def test_verify_against_another_step_fails_on_identity_and_values(
    two_tags: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    convert_checkpoint(str(two_tags), str(out), ConvertOptions(dtype="bf16"), tag="global_step2")
    code, stdout, _ = _run(
        capsys, "verify", str(out), "--against", str(two_tags), "--tag", "global_step4"
    )
    assert code == 1, stdout
    assert "source" in stdout and "contents differ" in stdout
    assert "values" in stdout and "differ from the checkpoint's master weights" in stdout
    code, stdout, _ = _run(
        capsys, "verify", str(out), "--against", str(two_tags), "--tag", "global_step2"
    )
    assert code == 0 and "source same contents" in stdout, stdout
    # without a manifest (e.g. another tool's output) the value sample still tells them apart
    (out / "zerosafe-manifest.json").unlink()
    (out / "zerosafe-complete.json").unlink()
    code, stdout, _ = _run(
        capsys, "verify", str(out), "--against", str(two_tags), "--tag", "global_step4"
    )
    assert code == 1 and "differ from the checkpoint's master weights" in stdout, stdout


# -- 7. one job, whatever the path's spelling ---------------------------------------------------------


def test_the_job_does_not_depend_on_how_paths_are_spelled(
    sample_ckpt: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    assert _run(capsys, "convert", "--via", "local", "ckpt", "out", "--keep-work")[0] == 0
    (out / "zerosafe-complete.json").unlink()  # an interrupted run, to be resumed elsewhere
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for ckpt, dest in (("../ckpt", "../out"), (str(sample_ckpt), f"file://{out}/")):
        code, stdout, err = _run(capsys, "convert", "--via", "local", ckpt, dest, "--keep-work")
        assert code == 0, err
        assert "already holds" not in err
    code, stdout, _ = _run(capsys, "convert", "--via", "local", "./../ckpt/", str(out))
    assert code == 0 and "nothing to do" in stdout


# -- 8, 9, 11, 13: one-line errors, early -----------------------------------------------------------


def test_unwritable_outputs_are_one_line_errors(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    for dest, words in ((a_file, "found a file"), (a_file / "sub", "Not a directory")):
        for mode in (["--via", "local"], []):
            code, _, err = _run(capsys, "convert", *mode, str(sample_ckpt), str(dest))
            assert words in _one_line_error(code, err)
    assert a_file.read_text() == "not a folder"


def test_a_read_only_filesystem_is_a_one_line_error(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        code, _, err = _run(capsys, "convert", "--via", "local", str(sample_ckpt), str(ro / "out"))
        assert "Read-only file system" in _one_line_error(code, err)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_marker_without_a_usable_manifest_is_a_one_line_error(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    convert_checkpoint(str(sample_ckpt), str(out))
    manifest = (out / "zerosafe-manifest.json").read_bytes()
    (out / "zerosafe-manifest.json").unlink()
    code, _, err = _run(capsys, "convert", "--via", "local", str(sample_ckpt), str(out))
    assert "zerosafe-manifest.json: missing" in _one_line_error(code, err)
    assert _run(capsys, "verify", str(out))[0] == 1
    (out / "zerosafe-manifest.json").write_bytes(manifest)
    (out / "zerosafe-complete.json").write_bytes(b"\x00garbage{")
    code, _, err = _run(capsys, "convert", "--via", "local", str(sample_ckpt), str(out))
    assert "completion marker" in _one_line_error(code, err) and "--overwrite" in err
    code, stdout, _ = _run(capsys, "verify", str(out))
    assert code == 1 and "completion marker not usable" in stdout
    assert (
        _run(capsys, "convert", "--via", "local", str(sample_ckpt), str(out), "--overwrite")[0] == 0
    )


@pytest.mark.parametrize(
    ("latest", "words"),
    [
        ("", "found an empty file"),
        ("global_step9", "names tag 'global_step9' but"),
        ("../..", "not a folder name inside the checkpoint folder"),
        ("/etc", "not a folder name inside the checkpoint folder"),
        ("global_step2/../../..", "not a folder name inside the checkpoint folder"),
    ],
)
def test_bad_latest_is_a_one_line_error(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], latest: str, words: str
) -> None:
    (sample_ckpt / "latest").write_text(latest)
    for cmd in (
        ["convert", "--via", "local", str(sample_ckpt), str(tmp_path / "out")],
        ["inspect", str(sample_ckpt)],
    ):
        code, _, err = _run(capsys, *cmd)
        assert words in _one_line_error(code, err), err
    code, _, err = _run(capsys, "inspect", str(sample_ckpt), "--tag", "../ckpt")
    assert "not a folder name" in _one_line_error(code, err)


def test_bad_input_is_refused_before_prefect_starts(tmp_path: Path) -> None:
    """An empty folder or a bad output answers without importing Prefect (whose embedded
    server takes seconds to start)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    code = textwrap.dedent(
        f"""
        import sys
        from zerosafe_app.cli import main
        codes = [main(["convert", {str(empty)!r}, {str(tmp_path / "out")!r}]),
                 main(["convert", {str(REPO / "examples" / "zero3-bf16-ws3")!r}, {str(a_file)!r}])]
        print(codes, "prefect" in sys.modules)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.stdout.strip() == "[2, 2] False", (proc.stdout, proc.stderr)
    assert proc.stderr.count("zerosafe: error: ") == 2


def test_manifest_files_record_their_published_identity(sample_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert_checkpoint(str(sample_ckpt), str(out))
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    (entry,) = manifest["files"]
    assert entry["version"] == str((out / "model.safetensors").stat().st_mtime_ns)
    assert len(manifest["source"]["content_sha256"]) == 64


def test_clean_keeps_what_a_live_output_lease_covers_and_finds_pending_shards(
    tmp_path: Path,
) -> None:
    from zerosafe.stages.clean import clean

    out = tmp_path / "out"
    pending = out / ".zerosafe-work" / "0123456789abcdef" / "pending"
    pending.mkdir(parents=True)
    (pending / "model.safetensors").write_bytes(b"x" * 100)
    with _holding_output(out):
        found = clean(Storage(), str(out), older_than_seconds=0, apply=True)
        assert [(f.kind, f.action) for f in found] == [("work-area", "live run")]
        assert (pending / "model.safetensors").exists()
    found = clean(Storage(), str(out), older_than_seconds=0, apply=True)
    assert [(f.kind, f.action) for f in found] == [("work-area", "removed")]
    assert not pending.exists()


def test_outputs_checked_with_sha256_by_earlier_versions_still_verify(
    sample_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """New manifests record XXH3-128 per tensor; a manifest of an earlier version records
    SHA-256, and verify recomputes whichever the record names."""
    import hashlib

    out = tmp_path / "out"
    convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions(dtype="bf16"))
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert all(set(r) >= {"xxh3_128"} and "sha256" not in r for r in manifest["tensors"].values())
    raw = (out / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    for name, record in manifest["tensors"].items():
        begin, end = header[name]["data_offsets"]
        data = raw[8 + header_len + begin : 8 + header_len + end]
        del record["xxh3_128"]
        record["sha256"] = hashlib.sha256(data).hexdigest()
    body = (json.dumps(manifest, indent=1) + "\n").encode()
    (out / "zerosafe-manifest.json").write_bytes(body)
    marker = json.loads((out / "zerosafe-complete.json").read_text())
    marker["manifest_sha256"] = hashlib.sha256(body).hexdigest()
    (out / "zerosafe-complete.json").write_text(json.dumps(marker))
    code, stdout, _ = _run(capsys, "verify", str(out))
    assert code == 0, stdout
    first = next(iter(manifest["tensors"]))
    manifest["tensors"][first]["sha256"] = "0" * 64
    body = (json.dumps(manifest, indent=1) + "\n").encode()
    (out / "zerosafe-manifest.json").write_bytes(body)
    marker["manifest_sha256"] = hashlib.sha256(body).hexdigest()
    (out / "zerosafe-complete.json").write_text(json.dumps(marker))
    code, stdout, _ = _run(capsys, "verify", str(out))
    assert code == 1 and "sha256" in stdout and first in stdout, stdout
