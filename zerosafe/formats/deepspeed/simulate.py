"""Plan a conversion from a metadata-only model description: no checkpoint, no data read.

`zerosafe inspect --simulate SPEC` describes a model (its parameter shapes) and how it was
trained (ZeRO stage 3, world size, training dtype, `sub_group_size`), lays the parameters out
the way DeepSpeed's ZeRO-3 does (`zerosafe.formats.deepspeed.layout`: `ceil(numel / world_size)` elements
per rank, per flat sub-group), and hands the result to `build_plan`, the planner every real
conversion uses. The files exist only as names, sizes and record offsets, so the plan's task
counts, bytes per task and memory per task are the ones a real checkpoint of that shape gets.

The predicted wall time is a model, not a measurement: `workers` workers each run
`options.parallel_tasks` tasks at once (what the memory budget allows); every running task
moves its bytes (reads plus writes) at `min(task_rate, bandwidth / tasks running)`, i.e. the
storage's aggregate bandwidth is shared and one task cannot go faster than its own copy
pipeline (`task_rate`, measured by bench/run.py); with `request_latency` (an object store's
time to first byte) each ranged request also waits that long, which lowers that task's rate.
On an object store extracts and merges coalesce their reads (`zerosafe.io.coalesce`, sized by
`zerosafe.stages.streaming.prefetch_limits`): the requests counted are the ones the engine's
own planner makes of the plan's fragments (read in place; intermediates hold the same pieces
in the same order), their waits spread over the requests in flight; verify's chunk reads wait
spread over its two reader threads. Staged mode runs every extract before the
first merge (under ZeRO-3 each output shard needs pieces of every rank), and a shard's verify
follows its merge in the same slot.

Spec (YAML or JSON)::

    name: llm-80b
    model:                      # Llama-style decoder; or `params: [[name, [dims...]], ...]`
      vocab_size: 128256
      hidden_size: 8192
      intermediate_size: 28672
      num_layers: 92
      num_kv_heads: 8
      head_dim: 128
      tie_word_embeddings: false
    checkpoint:
      zero_stage: 3
      world_size: 64
      train_dtype: bf16
      sub_group_size: 1000000000
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from zerosafe.config import ConvertOptions
from zerosafe.dtypes import ALIASES, OUTPUT_DTYPES, dtype_info
from zerosafe.errors import ConfigError
from zerosafe.formats.deepspeed.checkpoint import build_plan
from zerosafe.formats.deepspeed.layout import zero3_partition_numel
from zerosafe.formats.deepspeed.types import LoadedFile, ZeroCheckpoint
from zerosafe.formats.torch_zip import StorageRef, TensorRecord, TorchZipFile, ZipRecord
from zerosafe.io.coalesce import PlannedRead, plan_requests
from zerosafe.io.storage import JSON_MAX_BYTES, FileIdentity, Storage
from zerosafe.plan.model import Plan
from zerosafe.stages.streaming import prefetch_limits
from zerosafe.units import format_bytes

__all__ = [
    "DEFAULT_TASK_RATE_BYTES",
    "SimulatedSpec",
    "llama_shapes",
    "load_spec",
    "merge_requests",
    "predict_seconds",
    "render_simulation",
    "simulate_plan",
    "simulation_report",
]

DEFAULT_TASK_RATE_BYTES = 1_000_000_000
"""Bytes (read + written) one task moves per second when storage is not the limit. Measured:
one merge task of bench/run.py's 7B run (direct, engine driver, bf16) moved 1.3 GB/s (fp32 read,
bf16 written, read back to verify) on the 2-core benchmark machine, which others were using
too; rounded down. Each such task keeps about 1.3 cores busy."""

_RECORD_ALIGN = 64  # torch.save aligns record data to 64 bytes
_LOCAL_HEADER_BYTES = 30  # APPNOTE 4.3.7, before the name and extra field


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulatedSpec:
    """A model and how it was trained, with nothing but shapes."""

    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """Every trained parameter in module order."""
    tied: dict[str, str]
    """Alias -> target (`lm_head.weight` -> `model.embed_tokens.weight` when tied)."""
    world_size: int
    train_dtype: str
    sub_group_numel: int
    zero_stage: int = 3

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes)


def llama_shapes(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tie_word_embeddings: bool = False,
) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of a Llama-style decoder, with Hugging Face's names, in module order."""
    kv = num_kv_heads * head_dim
    h, f = hidden_size, intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab_size, h))]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (f, h)),
            (p + "mlp.up_proj.weight", (f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not tie_word_embeddings:
        shapes.append(("lm_head.weight", (vocab_size, h)))
    return shapes


def load_spec(path: str, *, world_size: int | None = None) -> SimulatedSpec:
    """Read a spec file (YAML, or JSON by its `.json` suffix); `world_size` overrides its own.

    Raises:
        ConfigError: Naming what is missing or not supported.
    """
    data = Storage().read_small(path, limit_bytes=JSON_MAX_BYTES, what="a simulation spec")
    text = data.decode("utf-8", "replace")
    if path.endswith(".json"):
        raw = json.loads(text)
    else:
        import yaml

        raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: a simulation spec is a mapping (see `zerosafe.formats.deepspeed.simulate`)"
        )
    ckpt = dict(raw.get("checkpoint") or {})
    stage = int(ckpt.get("zero_stage", 3))
    if stage != 3:
        raise ConfigError(
            f"{path}: `checkpoint.zero_stage` {stage} cannot be simulated yet; only ZeRO-3 "
            "(the layout large runs use) is laid out here"
        )
    train_dtype = str(ckpt.get("train_dtype", "bf16"))
    if train_dtype not in ALIASES or ALIASES[train_dtype] not in OUTPUT_DTYPES:
        raise ConfigError(f"{path}: `checkpoint.train_dtype` must be bf16, fp16 or fp32")
    tied: dict[str, str] = {}
    if "params" in raw:
        shapes = [(str(n), tuple(int(d) for d in s)) for n, s in raw["params"]]
        tied = {str(a): str(t) for a, t in (raw.get("tied") or {}).items()}
    elif "model" in raw:
        model = dict(raw["model"])
        try:
            shapes = llama_shapes(**model)
        except TypeError as e:
            raise ConfigError(f"{path}: `model` needs the fields of `llama_shapes`: {e}") from e
        if model.get("tie_word_embeddings"):
            tied = {"lm_head.weight": "model.embed_tokens.weight"}
    else:
        raise ConfigError(f"{path}: give `model` (Llama-style sizes) or `params` (shapes)")
    ws = world_size if world_size is not None else int(ckpt.get("world_size", 0))
    if ws < 1:
        raise ConfigError(f"{path}: `checkpoint.world_size` (or --world-size) must be at least 1")
    return SimulatedSpec(
        name=str(raw.get("name", path)),
        shapes=tuple(shapes),
        tied=tied,
        world_size=ws,
        train_dtype=train_dtype,
        sub_group_numel=int(float(ckpt.get("sub_group_size", 1e9))),
    )


class _SimulatedZip:
    """What the planner asks of a `TorchZipFile`: records by storage key and their offsets."""

    def __init__(self, url: str, archive: str, sizes: Sequence[int]) -> None:
        self.url = url
        self.records: dict[str, ZipRecord] = {}
        self._offsets: dict[str, int] = {}
        pos = 4096  # data.pkl and friends come first in torch's archives
        for key, size in enumerate(sizes):
            name = f"{archive}/data/{key}"
            header = _LOCAL_HEADER_BYTES + len(name)
            data = -(-(pos + header) // _RECORD_ALIGN) * _RECORD_ALIGN
            self.records[str(key)] = ZipRecord(
                name=name, header_offset=pos, size_bytes=size, crc32=0
            )
            self._offsets[name] = data
            pos = data + size + 16  # a data descriptor follows each record
        self.size_bytes = pos + 4096  # central directory and end records
        self.prefix = f"{archive}/"
        self.records[self.prefix + "data.pkl"] = ZipRecord(
            name=self.prefix + "data.pkl", header_offset=0, size_bytes=4096 - 64, crc32=0
        )
        self.directory_bytes = 4096

    def storage_record(self, key: str) -> ZipRecord:
        return self.records[key]

    def data_offset(self, record: ZipRecord) -> int:
        return self._offsets[record.name]


def _flat_record(key: int, numel: int) -> TensorRecord:
    return TensorRecord(
        storage=StorageRef(key=str(key), dtype="float32", numel=numel, location="cpu"),
        storage_offset=0,
        shape=(numel,),
        stride=(1,),
        dtype="float32",
    )


def simulated_checkpoint(spec: SimulatedSpec) -> ZeroCheckpoint:
    """A `ZeroCheckpoint` laid out as DeepSpeed 0.19 saves ZeRO-3 (see the module docstring).

    Optimizer groups: matrices (weight decay), then vectors, as DeepSpeed's usual split; each
    group is cut into flat sub-groups of at least `sub_group_numel` elements per rank.
    """
    ws = spec.world_size
    lowp_size = dtype_info(spec.train_dtype).itemsize
    prefix = "bf16_" if dtype_info(spec.train_dtype).name == "bfloat16" else ""  # bf16_zero_pp_*
    groups = [[s for s in spec.shapes if len(s[1]) >= 2], [s for s in spec.shapes if len(s[1]) < 2]]
    sub_groups: list[list[tuple[str, tuple[int, ...]]]] = []
    for group in groups:
        current: list[tuple[str, tuple[int, ...]]] = []
        total = 0
        for name, shape in group:
            current.append((name, shape))
            total += zero3_partition_numel(math.prod(shape), ws)
            if total >= spec.sub_group_numel:
                sub_groups.append(current)
                current, total = [], 0
        if current:
            sub_groups.append(current)
    per_rank = [sum(zero3_partition_numel(math.prod(s), ws) for _, s in g) for g in sub_groups]
    tag = "global_step1"
    base = f"simulated://{spec.name}/{tag}"
    optim_files, model_files, fp32 = [], [], []
    for rank in range(ws):
        # per sub-group: the fp32 partition, then Adam's two moments, as the real files hold
        sizes = [n * 4 for n in per_rank] + [n * 4 for n in per_rank for _ in range(2)]
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states"
        url = f"{base}/{name}.pt"
        zf = _SimulatedZip(url, name, sizes)
        optim_files.append(
            LoadedFile(
                url=url, role="optim", rank=rank, zip=cast(TorchZipFile, zf), obj={},
                identity=FileIdentity(url=url, size_bytes=zf.size_bytes, version="simulated"),
            )
        )  # fmt: skip
        fp32.append([_flat_record(g, n) for g, n in enumerate(per_rank)])
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states"
        url = f"{base}/{name}.pt"
        zf = _SimulatedZip(url, name, [])
        model_files.append(
            LoadedFile(
                url=url, role="model", rank=rank, zip=cast(TorchZipFile, zf), obj={},
                identity=FileIdentity(url=url, size_bytes=zf.size_bytes, version="simulated"),
            )
        )  # fmt: skip
    module_order = [n for n, _ in spec.shapes]
    for alias, target in spec.tied.items():
        module_order.insert(module_order.index(target) + 1, alias)
    return ZeroCheckpoint(
        ckpt_url=f"simulated://{spec.name}",
        tag=tag,
        tag_url=base,
        stage=3,
        optimizer_kind="zero",
        world_size=ws,
        train_dtype=dtype_info(spec.train_dtype).name,
        ds_version="0.19.8 (simulated)",
        optim_files=optim_files,
        model_files=model_files,
        param_groups=sub_groups,
        fp32_partitions=fp32,
        frozen=[],
        buffers=[],
        shared=dict(spec.tied),
        module_order=module_order,
        notes=[f"simulated from a metadata-only spec; {lowp_size}-byte training dtype"],
    )


def simulate_plan(spec: SimulatedSpec, options: ConvertOptions) -> tuple[ZeroCheckpoint, Plan]:
    """The plan `build_plan` makes for a checkpoint of this shape."""
    ckpt = simulated_checkpoint(spec)
    return ckpt, build_plan(ckpt, options)


_READERS_PER_TASK = 2  # zerosafe.stages.streaming.copy_stream's reader threads


def _phase_seconds(
    tasks: Sequence[tuple[int, float]], slots: int, bandwidth: float, task_rate: float
) -> float:
    """Processor sharing: running tasks split `bandwidth`, each capped at its own rate; a free
    slot takes the largest task left. A task is `(bytes moved, seconds of request latency)`;
    the latency lowers its cap to `bytes / (bytes / task_rate + latency)`."""
    pending = sorted(
        ((b, b / (b / task_rate + lat)) for b, lat in tasks if b > 0), key=lambda t: -t[0]
    )
    running: list[tuple[float, float]] = []  # (bytes left, cap)
    elapsed = 0.0
    while pending or running:
        while pending and len(running) < slots:
            b, cap = pending.pop(0)
            running.append((float(b), cap))
        share = bandwidth / len(running)
        rates = [min(cap, share) for _, cap in running]
        step = min(left / rate for (left, _), rate in zip(running, rates, strict=True))
        elapsed += step
        running = [
            (left - step * rate, cap)
            for (left, cap), rate in zip(running, rates, strict=True)
            if left - step * rate > 1e-6 * rate
        ]
    return elapsed


def _task_loads(
    plan: Plan, options: ConvertOptions, request_latency: float
) -> dict[str, list[tuple[int, float]]]:
    """Per task: bytes moved (read + written) and request latency, for extract parts and for
    merge + verify of each shard (verify reads the shard back)."""
    chunk = options.chunk_bytes

    def reads(nbytes: int) -> int:
        return -(-nbytes // chunk)

    wait = request_latency / _READERS_PER_TASK
    limits = prefetch_limits(chunk)
    coalesced_wait = request_latency / limits.in_flight
    extract = []
    if not options.direct:
        for i in range(len(plan.parts)):
            b = plan.part_bytes(i)
            extract.append((2 * b, -(-b // limits.max_request) * coalesced_wait))
    merge = []
    for i, shard in enumerate(plan.shards):
        lat = merge_requests(plan, i, chunk) * coalesced_wait if request_latency else 0.0
        lat += reads(shard.data_bytes) * wait  # verify
        merge.append((plan.shard_source_bytes(i) + 2 * shard.data_bytes, lat))
    return {"extract": extract, "merge_verify": merge}


def merge_requests(plan: Plan, shard: int, chunk_bytes: int) -> int:
    """Ranged requests a merge of `shard` makes on an object store: the engine's coalescing
    plan (`zerosafe.io.coalesce.plan_requests`) of its fragments, at the sizes the copy
    pipeline uses for `chunk_bytes` and the default transfer settings."""
    limits = prefetch_limits(chunk_bytes)
    reads = []
    for t in plan.shard_tensors(shard):
        for slot_index, start, numel, _ in plan.fragments.for_tensor(t.index):
            slot = plan.slots[slot_index]
            offset, nbytes = slot.byte_offset + start * slot.itemsize, numel * slot.itemsize
            step = limits.max_request - limits.max_request % slot.itemsize
            for pos in range(0, nbytes, step):
                n = min(step, nbytes - pos)
                reads.append(PlannedRead(slot.file, offset + pos, n, slot_index))
    requests, _ = plan_requests(reads, budget=limits.budget, max_request=limits.max_request)
    return len(requests)


def predict_seconds(
    plan: Plan,
    options: ConvertOptions,
    *,
    workers: int,
    bandwidth: float,
    task_rate: float,
    request_latency: float = 0.0,
) -> float:
    """Predicted wall time of the conversion (model in the module docstring).

    Args:
        request_latency: Seconds each ranged read waits before data flows (0 for local disks;
            tens of milliseconds for an object store), spread over a task's reader threads.
    """
    slots = workers * options.parallel_tasks
    loads = _task_loads(plan, options, request_latency)
    return sum(_phase_seconds(t, slots, bandwidth, task_rate) for t in loads.values() if t)


def _spread(values: Sequence[int]) -> dict[str, int]:
    if not values:
        return {"count": 0, "min": 0, "median": 0, "max": 0, "total": 0}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "min": ordered[0],
        "median": ordered[len(ordered) // 2],
        "max": ordered[-1],
        "total": sum(ordered),
    }


def simulation_report(
    spec: SimulatedSpec,
    plan: Plan,
    options: ConvertOptions,
    *,
    workers: Sequence[int],
    bandwidths: Sequence[float],
    task_rate: float = DEFAULT_TASK_RATE_BYTES,
    request_latency: float = 0.0,
) -> dict[str, Any]:
    """A JSON-able report: the plan's tasks, their bytes and memory, and predicted times."""
    frag_per_shard = []
    for i in range(len(plan.shards)):
        frag_per_shard.append(
            sum(len(plan.fragments.for_tensor(t.index)) for t in plan.shard_tensors(i))
        )
    requests_per_shard = (
        [merge_requests(plan, i, options.chunk_bytes) for i in range(len(plan.shards))]
        if request_latency
        else []
    )
    predictions = [
        {
            "workers": w,
            "bandwidth_bytes_per_s": b,
            "seconds": predict_seconds(
                plan,
                options,
                workers=w,
                bandwidth=b,
                task_rate=task_rate,
                request_latency=request_latency,
            ),  # fmt: skip
        }
        for b in bandwidths
        for w in workers
    ]
    return {
        "name": spec.name,
        "num_params": spec.num_params,
        "zero_stage": spec.zero_stage,
        "world_size": spec.world_size,
        "train_dtype": spec.train_dtype,
        "mode": "direct" if options.direct else "staged",
        "dtype": options.dtype,
        "max_shard_size": options.max_shard_size,
        "files": len(plan.files),
        "checkpoint_bytes": plan.source.checkpoint_bytes,
        "fp32_bytes": plan.fp32_bytes,
        "output_bytes": plan.total_out_bytes,
        "num_tensors": len(plan.tensors),
        "num_fragments": len(plan.fragments),
        "tasks": {
            "extract": _spread([plan.part_bytes(i) for i in range(len(plan.parts))])
            if not options.direct
            else _spread([]),
            "merge_source_bytes": _spread(
                [plan.shard_source_bytes(i) for i in range(len(plan.shards))]
            ),
            "merge_output_bytes": _spread([s.data_bytes for s in plan.shards]),
            "verify": _spread([s.data_bytes for s in plan.shards]),
            "reads_per_merge": _spread(frag_per_shard),
            # with request latency (an object store): the coalesced ranged requests
            "requests_per_merge": _spread(requests_per_shard),
        },
        "memory": {
            "budget_bytes": options.memory,
            "task_bytes": options.task_memory_bytes,
            "tasks_per_worker": options.parallel_tasks,
            "chunk_bytes": options.chunk_bytes,
        },
        "task_rate_bytes_per_s": task_rate,
        "request_latency_s": request_latency,
        "predictions": predictions,
        "job_key": plan.job_key,
    }


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def render_simulation(r: dict[str, Any]) -> str:
    """The report for people."""
    t = r["tasks"]
    lines = [
        f"Simulated {r['name']}: {r['num_params'] / 1e9:.1f}B params, ZeRO-{r['zero_stage']}, "
        f"world size {r['world_size']}, trained in {r['train_dtype']} (no files read)",
        f"  checkpoint {r['files']} files, {format_bytes(r['checkpoint_bytes'])}; fp32 masters "
        f"{format_bytes(r['fp32_bytes'])}; output {r['dtype']} {format_bytes(r['output_bytes'])}"
        f" in {t['merge_output_bytes']['count']} shard(s) of at most "
        f"{format_bytes(r['max_shard_size'])}; {r['num_tensors']} tensors, "
        f"{r['num_fragments']:,} fragments",
        f"Tasks ({r['mode']})",
    ]
    if t["extract"]["count"]:
        e = t["extract"]
        lines.append(
            f"  extract  {e['count']:5d}  copies {format_bytes(e['median'])} each (max "
            f"{format_bytes(e['max'])}): reads it from a rank file, writes an intermediate"
        )
    m, o = t["merge_source_bytes"], t["merge_output_bytes"]
    lines.append(
        f"  merge    {m['count']:5d}  reads {format_bytes(m['median'])} each (max "
        f"{format_bytes(m['max'])}) in ~{t['reads_per_merge']['median']:,} ranged reads"
        + (
            f" (~{t['requests_per_merge']['median']:,} coalesced requests from an object store)"
            if t.get("requests_per_merge", {}).get("count")
            else ""
        )
        + f", writes {format_bytes(o['median'])}"
    )
    lines.append(
        f"  verify   {t['verify']['count']:5d}  reads {format_bytes(t['verify']['median'])} each"
    )
    mem = r["memory"]
    lines.append(
        f"Memory      {format_bytes(mem['task_bytes'])} per task "
        f"({format_bytes(mem['chunk_bytes'])} chunks), {mem['tasks_per_worker']} task(s) per "
        f"worker under a {format_bytes(mem['budget_bytes'])} budget"
    )
    latency = (
        f", {r['request_latency_s'] * 1000:.0f} ms per ranged read"
        if r["request_latency_s"]
        else ""
    )
    lines.append(
        f"Predicted wall time (each task at most {format_bytes(r['task_rate_bytes_per_s'])}/s"
        f"{latency}; bandwidth shared by all workers)"
    )
    for p in r["predictions"]:
        lines.append(
            f"  {p['workers']:4d} worker(s) at {format_bytes(p['bandwidth_bytes_per_s'])}/s: "
            f"{_seconds(p['seconds'])}"
        )
    return "\n".join(lines)
