"""`--quantize` outputs keep the pipeline's guarantees (issue 41), on a forged ZeRO-3 Llama
(`bench.forge`, world size 4, every linear dimension a multiple of 128, `config.json` beside
`latest` as the HF Trainer saves it): a `zerosafe convert --quantize fp8-block` SIGKILLed midway
and run again gives the uninterrupted run's bytes, S3 into S3 on the moto server equals the
local run, `verify --against` passes and fails on a flipped byte, the flow `convert` on a Prefect
server gives the same bytes under its own job key, and every FP8 weight and scale is
transformers' `Fp8Quantize` of the forged fp32 masters, bit for bit (`tests/formats/robust.py`
has the shared checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import forge as F
from bench.run_quantize import check_fp8, llama_config, llama_shapes
from tests.app.flows.conftest import convert_json
from tests.formats.robust import RobustChecks, convert_here
from tests.io.s3.conftest import aws_environment, aws_home, bucket, moto  # noqa: F401 - fixtures
from tests.io.s3.support import assert_same_output

pytestmark = pytest.mark.slow

DIMS = {"width": 256, "ffn": 384, "kv": 128, "layers": 2, "vocab": 300}
SEED = 7


@pytest.fixture(scope="module")
def save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint folder a user passes: `latest`, `global_step1/`, `config.json`."""
    ckpt = tmp_path_factory.mktemp("fp8-robust") / "checkpoint-1"
    F.forge_checkpoint(
        ckpt, shapes=llama_shapes(DIMS), stage=3, world_size=4, dtype="bf16", tied=False,
        buffers=(), seed=SEED,
    )  # fmt: skip
    (ckpt / "config.json").write_text(json.dumps(llama_config(DIMS), indent=2))
    return ckpt


class TestRobust(RobustChecks):
    ARGS = ("--dtype", "bf16", "--quantize", "fp8-block", "--max-shard-size", "150KB")
    """Ten weights quantized over seven shards: a kill can land between quantizing merges."""

    def test_every_fp8_weight_is_the_reference_quantizer_of_the_masters(
        self, reference: Path
    ) -> None:
        check = check_fp8(str(reference), {n: list(s) for n, s in llama_shapes(DIMS)}, SEED)
        assert check["ok"], check["problems"]
        assert check["quantized"] == 7 * DIMS["layers"]
        assert len(list(reference.glob("model-*.safetensors"))) >= 3
        config = json.loads((reference / "config.json").read_text())
        assert config["quantization_config"]["modules_to_not_convert"] == [
            "model.embed_tokens", "lm_head"
        ]  # fmt: skip

    def test_flow_on_a_prefect_server(
        self,
        save: Path,
        reference: Path,
        prefect_env: dict[str, str],
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        """The flow `convert` with `--quantize`: the parameter reaches every task (the output is
        the command's own run, byte for byte), and the job key is not the bf16 one."""
        out = tmp_path / "out"
        summary = convert_json(prefect_env, str(save), str(out), "--via", "prefect", *self.ARGS)
        assert summary["status"] == "converted" and summary["via"] == "prefect", summary
        assert summary["integrity"]["records_failed"] == []
        assert_same_output(out, reference)
        plain = [a for a in self.ARGS if a not in ("--quantize", "fp8-block")]
        bf16 = convert_here(capsys, str(save), str(tmp_path / "bf16"), *plain)
        assert bf16["job_key"] != summary["job_key"]
