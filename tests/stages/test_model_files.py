"""Model files beside the weights (config, tokenizer), the config checks and `--keep-fp32`,
on the shipped ZeRO-3 sample (engine driver; the flow and real transformers are in
`test_transformers_output.py`)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import REPO, SAMPLE_CKPT
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.errors import ConfigError
from zerosafe.plan.model import job_key_of
from zerosafe.verify.output import verify_output
from zerosafe_app.cli import main

CONFIG = {"model_type": "tiny", "tie_word_embeddings": True, "dtype": "float32"}


@pytest.fixture
def hf_ckpt(sample_ckpt: Path) -> Path:
    """The sample with what `save_pretrained` writes beside `latest`, and what is not copied."""
    (sample_ckpt / "config.json").write_text(json.dumps(CONFIG))
    (sample_ckpt / "tokenizer.json").write_text('{"model": {}}')
    (sample_ckpt / "tokenizer_config.json").write_text("{}")
    (sample_ckpt / "training_args.bin").write_bytes(b"a pickle")
    (sample_ckpt / "additional_chat_templates").mkdir()
    (sample_ckpt / "additional_chat_templates" / "tool.jinja").write_text("{{ x }}")
    return sample_ckpt


def _manifest(out: Path) -> dict:
    return json.loads((out / "zerosafe-manifest.json").read_text())


def test_model_files_are_copied_recorded_and_verified(hf_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = convert_checkpoint(str(hf_ckpt), str(out), ConvertOptions())
    copied = ["config.json", "tokenizer.json", "tokenizer_config.json",
              "additional_chat_templates/tool.jinja"]  # fmt: skip
    assert [e["file"] for e in _manifest(out)["model_files"]] == copied
    assert _manifest(out)["model_files_from"] == str(hf_ckpt)
    assert not (out / "training_args.bin").exists() and not (out / "zero_to_fp32.py").exists()
    for name in copied:
        assert (out / name).read_bytes() == (hf_ckpt / name).read_bytes()
    assert any("copies 4 model file(s)" in n for n in summary.notes)
    assert not summary.warnings  # the sample ties lm_head, as the config says; fp32 both
    assert verify_output(str(out))["ok"]

    (out / "tokenizer.json").write_text('{"model": {"x": 1}}')
    report = verify_output(str(out))
    assert [(f["file"], f["check"]) for f in report["failures"]] == [
        ("tokenizer.json", "model file")
    ]
    # The same command again copies it anew, and only that: every shard is kept.
    again = convert_checkpoint(str(hf_ckpt), str(out), ConvertOptions())
    assert again.status == "converted" and verify_output(str(out))["ok"]
    assert (out / "tokenizer.json").read_bytes() == (hf_ckpt / "tokenizer.json").read_bytes()
    assert convert_checkpoint(str(hf_ckpt), str(out)).status == "already-complete"


def test_source_changes_are_copied_again(hf_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert_checkpoint(str(hf_ckpt), str(out))
    (hf_ckpt / "generation_config.json").write_text('{"max_length": 9}')
    (hf_ckpt / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 97}))
    assert convert_checkpoint(str(hf_ckpt), str(out)).status == "converted"
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 97
    assert (out / "generation_config.json").exists() and verify_output(str(out))["ok"]
    # Turned off: the copies go, the weights stay.
    assert (
        convert_checkpoint(str(hf_ckpt), str(out), ConvertOptions(copy_model_files=False)).status
        == "converted"
    )
    assert not (out / "config.json").exists() and not (out / "additional_chat_templates").exists()
    assert _manifest(out)["model_files"] == [] and verify_output(str(out))["ok"]


def test_model_files_from_another_folder(sample_ckpt: Path, tmp_path: Path) -> None:
    other = tmp_path / "hf"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "out"
    summary = convert_checkpoint(str(sample_ckpt), str(out), ConvertOptions())
    assert any("no config.json or tokenizer files" in n for n in summary.notes)
    assert (
        convert_checkpoint(
            str(sample_ckpt), str(out), ConvertOptions(model_files=str(other))
        ).status
        == "converted"
    )  # the same job: only the copies are made
    assert (out / "config.json").read_text() == json.dumps(CONFIG)


def test_model_files_errors_are_one_line(sample_ckpt: Path, tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    args = ["convert", "--via", "local", str(sample_ckpt), str(tmp_path / "o")]
    assert main([*args, "--model-files", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(missing) in err and "`--model-files`" in err
    assert main([*args, "--keep-fp32", "norm(", "--dtype", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "`--keep-fp32` pattern 'norm('" in err
    with pytest.raises(SystemExit):  # argparse: one or the other
        main([*args, "--model-files", str(tmp_path), "--no-model-files"])
    with pytest.raises(ConfigError, match="`model_files`"):
        ConvertOptions(model_files=str(tmp_path), copy_model_files=False)


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"tie_word_embeddings": False}, "`tie_word_embeddings` is false but the checkpoint ties"),
        ({"dtype": "bfloat16"}, "`dtype` is 'bfloat16' but the weights are written in float32"),
        ({"torch_dtype": "float16"}, "`torch_dtype` is 'float16'"),
    ],
)
def test_config_disagreements_are_warned(
    sample_ckpt: Path, config: dict, want: str, capsys
) -> None:
    (sample_ckpt / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(sample_ckpt), "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert len(warnings) == 1 and want in warnings[0], warnings


def test_tie_true_without_alias_is_warned(sample_ckpt: Path, capsys) -> None:
    from zerosafe.stages.model_files import check_model_config

    (warning,) = check_model_config(
        {"tie_word_embeddings": True}, "c.json", out_dtype="float32", aliases={}
    )
    assert "ties no tensors" in warning
    assert check_model_config({}, "c.json", out_dtype="float32", aliases={"a": "b"}) == []


def test_keep_fp32(tmp_path: Path) -> None:
    out = tmp_path / "out"
    options = ConvertOptions(dtype="bf16", keep_fp32=("norm", r"^side\.bias$"))
    summary = convert_checkpoint(str(SAMPLE_CKPT), str(out), options)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    kept = {k for k, d in dtypes.items() if d == "F32"}
    assert kept == {k for k in dtypes if "norm" in k} | {"side.bias"}
    assert {d for k, d in dtypes.items() if k not in kept} == {"BF16", "I64"}
    assert _manifest(out)["options"]["keep_fp32"] == ["norm", r"^side\.bias$"]
    assert any("kept in float32" in n for n in summary.notes)
    assert verify_output(str(out), against=str(SAMPLE_CKPT))["ok"]
    options = ConvertOptions(dtype="bf16", keep_fp32=("nothing_matches",))
    assert (
        "matches no floating tensor"
        in convert_checkpoint(str(SAMPLE_CKPT), str(tmp_path / "o2"), options).warnings[0]
    )


def test_job_keys_without_new_options_do_not_change() -> None:
    """Outputs converted before these options existed must still count as done."""
    before = {"dtype": "float32", "max_shard_bytes": 5 * 10**9, "tied": "dedupe",
              "exclude_frozen": False}  # fmt: skip
    assert ConvertOptions().identity() == before
    assert ConvertOptions(model_files="/x", copy_model_files=True).identity() == before
    assert ConvertOptions(copy_model_files=False).identity() == before
    key = job_key_of("t", [], ConvertOptions())
    assert job_key_of("t", [], ConvertOptions(keep_fp32=("norm",))) != key
    assert ConvertOptions(keep_fp32=["a"]).keep_fp32 == ("a",)  # type: ignore[arg-type]


# -- issue 24: model files are copied safely (items 2, 4, 5, 6) -----------------------------------


def _run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_model_files_from_the_output_are_refused(
    hf_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24 item 2: `--model-files OUT` on a complete output removed its config.json and
    tokenizer files (the repair removes the copies, then copies from where they were), exit 0."""
    out = tmp_path / "out"
    convert_checkpoint(str(hf_ckpt), str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    (out / "sub").mkdir()
    for folder in (out, out / "sub", tmp_path / "out" / "."):
        code, err = _run_cli(
            capsys,
            "convert",
            "--via",
            "local",
            str(hf_ckpt),
            str(out),
            "--model-files",
            str(folder),
        )
        assert code == 2 and err.count("\n") == 1, err
        assert "`--model-files`" in err and "inside the output" in err and str(out) in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert verify_output(str(out))["ok"]
    # The checkpoint folder (where model files come from by default) inside the output, too.
    (tmp_path / "config.json").write_text("{}")
    code, err = _run_cli(
        capsys, "convert", "--via", "local", str(hf_ckpt), str(tmp_path), "--overwrite"
    )
    # refused before the model files are looked at: an output holding its checkpoint
    assert code == 2 and err.count("\n") == 1 and "a folder holding the checkpoint" in err, err
    assert (tmp_path / "config.json").exists() and (hf_ckpt / "config.json").exists()


def test_a_link_out_of_the_folder_is_skipped_and_modes_are_never_widened(
    hf_ckpt: Path, tmp_path: Path
) -> None:
    """Issue 24 item 4: a `tokenizer.model` linking to a 0600 file elsewhere was copied into
    the output as a 0644 file."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for upload")
    secret.chmod(0o600)
    (hf_ckpt / "tokenizer.model").symlink_to(secret)
    (hf_ckpt / "tokenizer.json").chmod(0o600)
    (hf_ckpt / "real").mkdir()
    (hf_ckpt / "real" / "merges.txt").write_text("a b\n")
    (hf_ckpt / "merges.txt").symlink_to("real/merges.txt")  # stays inside: copied
    out = tmp_path / "out"
    summary = convert_checkpoint(str(hf_ckpt), str(out))
    assert not (out / "tokenizer.model").exists()
    assert any("tokenizer.model" in w and "outside" in w for w in summary.warnings), summary
    copied = [e["file"] for e in _manifest(out)["model_files"]]
    assert "tokenizer.model" not in copied and "merges.txt" in copied
    assert (out / "merges.txt").read_text() == "a b\n" and not (out / "merges.txt").is_symlink()
    assert (out / "tokenizer.json").stat().st_mode & 0o777 == 0o600
    assert verify_output(str(out))["ok"]
    assert convert_checkpoint(str(hf_ckpt), str(out)).status == "already-complete"


def _convert_in_subprocess(ckpt: Path, out: Path) -> subprocess.CompletedProcess[str]:
    # A child process, so that the hang this guards against fails the test instead of it.
    return subprocess.run(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--via", "local", str(ckpt), str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip


def test_a_fifo_named_like_a_model_file_is_skipped(hf_ckpt: Path, tmp_path: Path) -> None:
    """Issue 24 item 5: a FIFO named `config.json` hung `convert` forever."""
    (hf_ckpt / "config.json").unlink()
    os.mkfifo(hf_ckpt / "config.json")
    os.mkfifo(hf_ckpt / "vocab.txt")
    out = tmp_path / "out"
    done = _convert_in_subprocess(hf_ckpt, out)
    assert done.returncode == 0, done.stderr
    assert "config.json" in done.stderr and "not a regular file" in done.stderr
    copied = [e["file"] for e in _manifest(out)["model_files"]]
    assert "config.json" not in copied and "vocab.txt" not in copied and copied
    assert verify_output(str(out))["ok"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_named_like_a_model_file_is_skipped(hf_ckpt: Path, tmp_path: Path) -> None:
    """Issue 24 item 5: a device (`/dev/zero`'s) as a model file ran out of memory."""
    (hf_ckpt / "config.json").unlink()
    os.mknod(hf_ckpt / "config.json", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    os.mknod(hf_ckpt / "tokenizer.model", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    out = tmp_path / "out"
    done = _convert_in_subprocess(hf_ckpt, out)
    assert done.returncode == 0, done.stderr
    assert "tokenizer.model" in done.stderr and "not a regular file" in done.stderr
    assert not (out / "config.json").exists() and not (out / "tokenizer.model").exists()


def test_model_files_are_streamed_within_the_memory_budget(hf_ckpt: Path, tmp_path: Path) -> None:
    """Issue 24 item 6: a 1.5 GB tokenizer file was read whole (1.9 GB peak under a 64 MB
    budget). Python's allocations while converting, copying and verifying stay far below it."""
    big = hf_ckpt / "tokenizer.model"
    with open(big, "wb") as f:
        f.truncate(96 * 2**20)  # sparse: cheap to make, read as zeros
    out = tmp_path / "out"
    tracemalloc.start()
    try:
        convert_checkpoint(str(hf_ckpt), str(out), ConvertOptions(memory=64 * 2**20))
        assert verify_output(str(out))["ok"]
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 40 * 2**20, peak_bytes
    entry = next(e for e in _manifest(out)["model_files"] if e["file"] == "tokenizer.model")
    assert entry["size_bytes"] == 96 * 2**20
    assert entry["sha256"] == hashlib.sha256(bytes(96 * 2**20)).hexdigest()


def test_a_config_over_the_cap_is_not_parsed(hf_ckpt: Path, capsys) -> None:
    """Issue 24 item 6: config.json was parsed whatever its size; one over 16 MiB is not a
    transformers config, so it is copied but not read, with a warning."""
    (hf_ckpt / "config.json").write_text(
        json.dumps({"tie_word_embeddings": False, "x": "y" * 2**24})
    )
    assert main(["inspect", str(hf_ckpt), "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert len(warnings) == 1 and "config.json" in warnings[0] and "16 MiB" in warnings[0]


def test_an_olmo_core_experiment_config_is_not_copied(hf_ckpt: Path, tmp_path: Path) -> None:
    """Issue 26: OLMo-core's trainer writes its experiment config as `stepN/config.json`
    (`json.dumps` of `Config.as_config_dict()`); beside the weights, from_pretrained would
    take it for a transformers config. It is skipped, saying why; the tokenizer still comes."""
    from olmo_core.nn.transformer import TransformerConfig

    model = TransformerConfig.llama_like(d_model=64, vocab_size=128, n_layers=2, n_heads=4)
    experiment = {"run_name": "r", "model": model.as_config_dict()}
    (hf_ckpt / "config.json").write_text(json.dumps(experiment))
    out = tmp_path / "out"
    summary = convert_checkpoint(str(hf_ckpt), str(out), ConvertOptions())
    assert [e["file"] for e in _manifest(out)["model_files"]] == [
        "tokenizer.json", "tokenizer_config.json", "additional_chat_templates/tool.jinja",
    ]  # fmt: skip
    assert not (out / "config.json").exists()
    (warning,) = [w for w in summary.warnings if "config.json" in w]
    assert "OLMo-core's experiment config" in warning and "not copied" in warning
    assert verify_output(str(out))["ok"]
