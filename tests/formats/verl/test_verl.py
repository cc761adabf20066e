"""verl FSDP checkpoints (written by verl's own `FSDPCheckpointManager`, see conftest.py) through
the `zerosafe` command: bit-exact against the live weights and verl's own `model_merger`, the
same logits from `from_pretrained`, and one-line refusals of what is not read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # a test dependency: a missing one fails, never skips
from safetensors.torch import load_file

from tests.helpers import assert_refused_in_one_line, zerosafe_child
from tests.rss import PeakRSS
from zerosafe.formats.torch_pickle import ALLOWED_GLOBALS, DTensorRecord
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.formats.verl.shards import shard_rows
from zerosafe.io.storage import Storage
from zerosafe_app.cli import main

Run = Callable[[str], Path]
ACTOR = "global_step_2/actor"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def convert(capsys: pytest.CaptureFixture[str], src: Path, out: Path) -> dict[str, Any]:
    code, stdout, err = run(capsys, "convert", str(src), str(out), "--via", "local", "--json")
    assert code == 0, err
    return dict(json.loads(stdout))


def refused(capsys: pytest.CaptureFixture[str], src: Path, out: Path) -> str:
    code, _, err = run(capsys, "convert", str(src), str(out), "--via", "local")
    assert code == 2, err
    line = err.strip()
    assert "\n" not in line and line.startswith("zerosafe: error: "), err
    assert not out.exists() or not any(out.iterdir())  # nothing written
    return line


def test_shard_rows_split_as_torch_chunk() -> None:
    assert shard_rows(67, 2) == [34, 33]
    assert shard_rows(3, 4) == [1, 1, 1, 0]
    assert shard_rows(8, 4) == [2, 2, 2, 2]
    assert shard_rows(0, 2) == [0, 0]
    for rows in range(0, 20):
        for world in range(1, 6):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            want = [len(c) for c in chunks] + [0] * (world - len(chunks))
            assert shard_rows(rows, world) == want


@pytest.mark.slow
def test_rank_files_unpickle_to_dtensor_records(verl_run: Run) -> None:
    """Each DTensor comes back as data: its global shape, its spec's placement and this
    rank's local shard; only allowlisted globals were named, and no DTensor code ran."""
    path = verl_run("fsdp2") / ACTOR / "model_world_size_2_rank_1.pt"
    archive = TorchZipFile(Storage().open_source(str(path)))
    state = archive.load()
    archive.source.close()
    emb = state["model.embed_tokens.weight"]
    assert isinstance(emb, DTensorRecord)
    assert emb.shape == (67, 24) and emb.local.shape == (33, 24)  # the uneven last shard
    assert [(p.qualname.rsplit(".", 1)[-1], p.get("dim")) for p in emb.placements] == [("Shard", 0)]
    assert archive.globals_found <= set(ALLOWED_GLOBALS)
    assert "torch.distributed.tensor.DTensor" in archive.globals_found


@pytest.mark.slow
def test_fsdp2_actor_is_bit_exact_to_the_live_weights_and_verls_merger(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root, out = verl_run("fsdp2"), tmp_path / "out"
    summary = convert(capsys, root / ACTOR, out)
    assert summary["status"] == "converted" and not summary["warnings"]
    got = load_file(out / "model.safetensors")
    live = load_file(root / "live.safetensors")
    # the tied head is stored once and recorded as an alias, as verl's merger drops it
    assert set(live) - set(got) == {"lm_head.weight"}
    manifest = json.loads((out / "zerosafe-manifest.json").read_text())
    assert json.dumps(manifest).count("lm_head.weight") >= 1
    for name, tensor in got.items():
        assert tensor.dtype == live[name].dtype == torch.float32, name
        assert torch.equal(tensor, live[name]), name
    # verl's model_merger writes bf16 (it casts every shard); same names, same values after
    # that one cast
    merged = load_file(verl_run("merger") / "merged" / "model.safetensors")
    assert set(merged) == set(got)
    for name, tensor in merged.items():
        assert torch.equal(got[name].to(torch.bfloat16), tensor), name
    # model files from huggingface/; the optimizer and extra state were never opened
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    read = [f["url"] for f in manifest["source"]["files"]]
    assert read and not any("optim_" in u or "extra_state_" in u for u in read)


@pytest.mark.slow
def test_fsdp2_actor_logits_equal_the_live_model(
    verl_run: Run, prefect_env: dict[str, str], tmp_path: Path
) -> None:
    """The real command as a user runs it (the Prefect flow, embedded), then `from_pretrained`."""
    root, out = verl_run("fsdp2"), tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--json", str(root / ACTOR), str(out)],
        capture_output=True, text=True, env=prefect_env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["status"] == "converted"
    live = load_file(root / "live-logits.safetensors")["logits"]
    input_ids = torch.arange(2 * 9).reshape(2, 9) % 67  # make_verl_checkpoint.input_ids()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the training ranks ran: the same reduction order
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
    finally:
        torch.set_num_threads(threads)
    assert model.config.tie_word_embeddings
    assert torch.equal(logits, live)


@pytest.mark.slow
def test_replicated_dtensors_convert_bit_exact(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root, out = verl_run("replicate"), tmp_path / "out"
    convert(capsys, root / "global_step_1/actor", out)
    got = load_file(out / "model.safetensors")
    live = load_file(root / "live.safetensors")
    assert set(live) - set(got) == {"lm_head.weight"}
    assert all(torch.equal(t, live[n]) for n, t in got.items())


@pytest.mark.slow
def test_verify_against_the_checkpoint(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt, out = verl_run("fsdp2") / ACTOR, tmp_path / "out"
    convert(capsys, ckpt, out)
    code, stdout, err = run(capsys, "verify", str(out), "--against", str(ckpt))
    assert code == 0, stdout + err
    assert "source same contents" in stdout


@pytest.mark.slow
def test_a_dim1_shard_is_refused_in_one_line(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = refused(capsys, verl_run("shard1") / "global_step_1/actor", tmp_path / "out")
    assert "placements ['Shard(1)']" in line and "model_merger" in line


def _copy_actor(verl_run: Run, tmp_path: Path) -> Path:
    src = verl_run("fsdp2") / ACTOR
    dest = tmp_path / "actor"
    shutil.copytree(src, dest)
    return dest


@pytest.mark.slow
def test_a_missing_rank_is_refused_in_one_line(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    actor = _copy_actor(verl_run, tmp_path)
    (actor / "model_world_size_2_rank_1.pt").unlink()
    line = refused(capsys, actor, tmp_path / "out")
    assert "rank(s) [1] are missing" in line


@pytest.mark.slow
def test_a_world_size_mismatch_is_refused_in_one_line(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    actor = _copy_actor(verl_run, tmp_path)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    line = refused(capsys, actor, tmp_path / "out")
    assert "world_size 4" in line and "world size 2" in line


@pytest.mark.slow
def test_rank_files_of_two_world_sizes_are_refused_in_one_line(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    actor = _copy_actor(verl_run, tmp_path)
    shutil.copy(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_1_rank_0.pt")
    line = refused(capsys, actor, tmp_path / "out")
    assert "several world sizes" in line


@pytest.mark.slow
def test_swapped_rank_files_are_refused_in_one_line(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each DTensor's mesh records the rank's coordinate, which the file name contradicts."""
    actor = _copy_actor(verl_run, tmp_path)
    a, b = actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_2_rank_1.pt"
    a.rename(tmp_path / "r0")
    b.rename(a)
    (tmp_path / "r0").rename(b)
    line = refused(capsys, actor, tmp_path / "out")
    assert "rank 0's file holds the shard of mesh coordinate [1], not [0]" in line


@pytest.mark.slow
def test_an_fsdp1_actor_converts_bit_exact(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """verl wraps FSDP1 with its device mesh, so the sharded state dict holds DTensors too.
    FSDP1 saves a tied head as a separate copy (its own storage), so both names are written."""
    root, out = verl_run("fsdp1"), tmp_path / "out"
    actor = root / "global_step_1/actor"
    assert json.loads((actor / "fsdp_config.json").read_text())["FSDP_version"] == 1
    summary = convert(capsys, actor, out)
    notes = json.dumps(summary)
    assert "lm_head.weight is saved apart from model.embed_tokens.weight" in notes, notes
    got = load_file(out / "model.safetensors")
    live = load_file(root / "live.safetensors")
    assert set(got) == set(live)
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert all(torch.equal(t, live[n]) for n, t in got.items())


@pytest.mark.slow
def test_fsdp1_sharded_tensors_are_refused_in_one_line(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """FSDP1 without a device mesh saves `ShardedTensor`s: refused by name, no code run."""
    line = refused(capsys, verl_run("sharded_tensor") / "global_step_1/actor", tmp_path / "out")
    assert "ShardedTensor" in line and "FULL_STATE_DICT" in line


@pytest.mark.slow
def test_a_lora_actor_converts_bit_exact_under_its_state_dict_names(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A peft LoRA actor under FSDP2: every tensor bit-exact under the state dict's own (PEFT)
    names, with a warning that this is not the base model's HF layout (no adapter output yet)."""
    root, out = verl_run("lora"), tmp_path / "out"
    summary = convert(capsys, root / "global_step_1/actor", out)
    assert any("LoRA actor (8 LoRA tensors)" in w for w in summary["warnings"]), summary
    got = load_file(out / "model.safetensors")
    live = load_file(root / "live.safetensors")
    assert set(live) - set(got) == {"base_model.model.lm_head.weight"}  # tied: an alias
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight" in got
    assert all(torch.equal(t, live[n]) for n, t in got.items())
    # verl's merger: the base model under its own names, the adapter apart without `.default`,
    # every tensor cast to bf16; the same values after that cast and renaming
    merged = verl_run("lora-merger") / "merged"
    theirs = load_file(merged / "model.safetensors")
    theirs.update(load_file(merged / "lora_adapter" / "adapter_model.safetensors"))
    for name, tensor in got.items():
        if ".lora_" in name:
            name = name.replace(".default.weight", ".weight")
        else:
            name = name.replace("base_model.model.", "").replace(".base_layer.", ".")
        assert torch.equal(tensor.to(torch.bfloat16), theirs.pop(name)), name
    assert not theirs


@pytest.mark.slow
def test_inspect_and_the_job_identity(verl_run: Run, capsys: pytest.CaptureFixture[str]) -> None:
    """`inspect` says what it found; the job key's identities, from a listing, are the files
    the reader reads; `--tag` is the save's own or refused."""
    from zerosafe.config import ConvertOptions
    from zerosafe.errors import ConfigError
    from zerosafe.formats.registry import quick_identities, read_source

    ckpt = verl_run("fsdp2") / ACTOR
    code, stdout, err = run(capsys, "inspect", str(ckpt))
    assert code == 0, err
    assert "(verl, FSDP2, world size 2)" in stdout
    assert "Shard(0) x 20 (1 split unevenly over the ranks)" in stdout
    assert "tied: lm_head.weight -> model.embed_tokens.weight" in stdout
    storage, options = Storage(), ConvertOptions()
    layout = read_source(storage, str(ckpt), tag=None, options=options)
    assert quick_identities(storage, str(ckpt), None) == (layout.tag, layout.identities)
    assert layout.tag == ACTOR and [f.role for f in layout.files] == ["metadata", "model", "model"]
    assert read_source(storage, str(ckpt), tag=ACTOR, options=options).tag == ACTOR
    with pytest.raises(ConfigError, match="one save"):
        read_source(storage, str(ckpt), tag="global_step_9", options=options)


@pytest.mark.slow
def test_the_global_step_folder_converts_its_actor(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`global_step_2/` (the folder a user has) holds one save, `actor/`: converted, with a
    note saying so, the model files still from `actor/huggingface/`."""
    root, out = verl_run("fsdp2"), tmp_path / "out"
    summary = convert(capsys, root / "global_step_2", out)
    assert "the only save in" in json.dumps(summary) and "verl FSDP" in json.dumps(summary)
    got = load_file(out / "model.safetensors")
    live = load_file(root / "live.safetensors")
    assert all(torch.equal(t, live[n]) for n, t in got.items()) and len(got) == 20
    assert (out / "tokenizer.json").is_file()


@pytest.mark.slow
def test_a_global_step_folder_with_actor_and_critic_lists_both(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    step = tmp_path / "global_step_2"
    step.mkdir()
    for name in ("actor", "critic"):
        shutil.copytree(verl_run("fsdp2") / ACTOR, step / name)
    line = refused(capsys, step, tmp_path / "out")
    assert "actor" in line and "critic" in line


@pytest.mark.slow
def test_pt2st_on_one_rank_file_says_to_convert_the_folder(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rank_file = verl_run("fsdp2") / ACTOR / "model_world_size_2_rank_0.pt"
    code, _, err = run(capsys, "pt2st", str(rank_file), str(tmp_path / "x.safetensors"))
    assert code == 2, err
    assert "is a DTensor" in err and "zerosafe convert" in err and "\n" not in err.strip()


def test_a_fifo_named_fsdp_config_is_refused_not_waited_on(verl_run: Run, tmp_path: Path) -> None:
    """Issue 37 item 8: a FIFO named `fsdp_config.json` hung `convert` forever."""
    actor = _copy_actor(verl_run, tmp_path)
    (actor / "fsdp_config.json").unlink()
    os.mkfifo(actor / "fsdp_config.json")
    proc = zerosafe_child("convert", "--via", "local", actor, tmp_path / "out", timeout_s=60)
    assert_refused_in_one_line(proc, "fsdp_config.json: expected verl's", "found a FIFO")


def test_a_huge_fsdp_config_is_refused_before_it_is_read(
    verl_run: Run, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 37 item 8: a 3 GB `fsdp_config.json` took 3.2 GB of memory before its refusal
    (only its first 64 KiB were parsed); a sparse file costs the test no disk."""
    actor = _copy_actor(verl_run, tmp_path)
    with open(actor / "fsdp_config.json", "r+b") as f:
        f.truncate(2 * 2**30)
    with PeakRSS() as rss:
        line = refused(capsys, actor, tmp_path / "out")
    assert f"found {2 * 2**30} bytes" in line and "at most 65536 bytes" in line
    assert rss.peak - rss.baseline < 256 * 2**20
