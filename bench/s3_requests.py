"""Ranged requests of a conversion from S3, before and after coalescing, in one run.

    .venv/bin/python bench/s3_requests.py --params 200M --world-size 64 --latency-ms 30

Forges a ZeRO-3 checkpoint (bench/forge/), starts moto's S3 server on loopback with the fault
proxy of the S3 tests in front of it (tests/io/s3/faultproxy.py), which holds every request
`--latency-ms` before forwarding it (a store's time to first byte; product code is untouched),
uploads the checkpoint, then converts it S3 -> S3 with the engine (`convert_checkpoint`,
default options: staged mode, as `auto` picks for an object store) twice in the same process:
`before` with `zerosafe.stages.streaming.COALESCE_READS` off (one ranged GET per fragment
chunk, as before) and `after` with it on. Per merge it records the GETs the proxy saw, their
bytes and the merge's wall time (the merge reads the intermediates; nothing else runs during
it); per run, the GETs of each phase (checkpoint: plan + extract + publish's CRC gap reads;
intermediates: merges + publish's header reads; output: verify) and the wall time. Both
outputs must equal the local conversion of the same checkpoint byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.io.s3.faultproxy import Fault, FaultProxy  # noqa: E402
from tests.io.s3.support import (  # noqa: E402
    MOTO_PART_MIN_BYTES,
    aws_env,
    free_port,
    s3_client,
    upload_folder,
    with_group,
)

METHODS = ("GET", "PUT", "POST", "HEAD", "DELETE")


def start_moto(log: Path) -> tuple[subprocess.Popen[Any], int]:
    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(MOTO_PART_MIN_BYTES)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start: {log.read_text()}") from None
            time.sleep(0.2)


def s3_sha256(endpoint: str, bucket: str, prefix: str) -> dict[str, str]:
    client = s3_client(endpoint)
    out = {}
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        name = obj["Key"][len(prefix) + 1 :]
        if name.startswith("model") and name.endswith(".safetensors"):
            digest = hashlib.sha256()
            for chunk in client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].iter_chunks(
                8 << 20
            ):
                digest.update(chunk)
            out[name] = digest.hexdigest()
    return out


def local_sha256(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.glob("model*.safetensors")):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
        out[path.name] = digest.hexdigest()
    return out


def _gets(proxy: FaultProxy, prefix: str) -> tuple[int, int]:
    gets = proxy.requests("GET", prefix)
    return len(gets), sum(g.body_bytes for g in gets)


def convert_once(
    label: str, coalesce: bool, src: str, bucket: str, proxy: FaultProxy
) -> dict[str, Any]:
    import zerosafe.pipeline as pipeline
    from zerosafe.config import ConvertOptions
    from zerosafe.driver import convert_checkpoint
    from zerosafe.io.storage import Storage
    from zerosafe.stages import streaming

    streaming.COALESCE_READS = coalesce
    merges: list[dict[str, Any]] = []
    original = pipeline.merge_shard

    def traced_merge(*args: Any, **kwargs: Any) -> Any:
        plan, shard = args[0], args[1]
        fragments = sum(len(plan.fragments.for_tensor(t.index)) for t in plan.shard_tensors(shard))
        before = len(proxy.requests("GET")), proxy.body_bytes("GET")
        started = time.monotonic()
        result = original(*args, **kwargs)
        seconds = time.monotonic() - started
        gets = len(proxy.requests("GET")) - before[0]
        got = proxy.body_bytes("GET") - before[1]
        merges.append(
            {
                "shard": shard,
                "fragments": fragments,
                "get_requests": gets,
                "bytes": got,
                "bytes_per_request": round(got / max(gets, 1)),
                "seconds": round(seconds, 2),
            }
        )
        return result

    pipeline.merge_shard = traced_merge  # type: ignore[assignment]
    out = f"s3://{bucket}/out-{label}"
    proxy.clear()
    storage = Storage({"endpoint_url": proxy.url})
    started = time.monotonic()
    try:
        summary = convert_checkpoint(src, out, ConvertOptions(), storage=storage)
    finally:
        pipeline.merge_shard = original  # type: ignore[assignment]
    wall = time.monotonic() - started
    ckpt_n, ckpt_b = _gets(proxy, f"/{bucket}/ckpt/")
    work_n, work_b = _gets(proxy, f"/{bucket}/out-{label}/.zerosafe-work/")
    all_n, all_b = _gets(proxy, "/")
    stats = summary.to_json() if hasattr(summary, "to_json") else dict(summary)
    return {
        "label": label,
        "coalesce": coalesce,
        "status": stats.get("status"),
        "wall_s": round(wall, 2),
        "merges": merges,
        "get_requests": {
            "checkpoint": ckpt_n,
            "intermediates": work_n,
            "output_and_other": all_n - ckpt_n - work_n,
            "total": all_n,
        },
        "get_bytes": {
            "checkpoint": ckpt_b,
            "intermediates": work_b,
            "output_and_other": all_b - ckpt_b - work_b,
            "total": all_b,
        },
        "all_requests": len(proxy.requests()),
        "peak_ranged_in_flight": proxy.peak_ranged_in_flight,
        "out": out,
    }


_LOG_LINE = re.compile(r"\[\d+/\w+/\d+ (\d+):(\d+):(\d+)\] \"(\w+) (\S+)")


def server_phases(moto_log: Path, label: str, bucket: str) -> dict[str, dict[str, int]]:
    """From moto's request log (1 s stamps): per phase of run `label`, its requests and when
    they came, in seconds from the run's first request. Phases by key: the checkpoint (plan and
    extract), the intermediates (written by extracts, read by merges and publish's checks), the
    unpublished output (`pending/`: merge writes, verify reads), and the rest (leases, publish)."""
    rows = []
    for line in moto_log.read_text(errors="replace").splitlines():
        m = _LOG_LINE.search(line)
        if m:
            h, mi, sec, method, path = m.groups()
            rows.append((int(h) * 3600 + int(mi) * 60 + int(sec), method, path.split("?")[0]))
    mine = [i for i, r in enumerate(rows) if f"/{bucket}/out-{label}" in r[2]]
    if not mine:
        return {}
    seg = rows[mine[0] : mine[-1] + 1]
    t0 = seg[0][0]
    out: dict[str, dict[str, int]] = {}
    for t, method, path in seg:
        if f"/{bucket}/ckpt/" in path:
            kind = "checkpoint"
        elif "/intermediate" in path:
            kind = "intermediates"
        elif "/pending/" in path:
            kind = "pending_output"
        elif f"/out-{label}" in path:
            kind = "other"
        else:
            continue
        entry = out.setdefault(f"{kind} {method}", {"requests": 0, "from_s": t - t0})
        entry["requests"] += 1
        entry["to_s"] = t - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="200M")
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--latency-ms", type=float, default=30.0)
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "reported", "s3-requests.json"))
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop moto on the way out

    from bench.forge import forge_checkpoint, transformer_shapes
    from zerosafe.cast import serial_torch
    from zerosafe.config import ConvertOptions
    from zerosafe.driver import convert_checkpoint

    serial_torch()
    work = Path(args.work or tempfile.mkdtemp(prefix="zs-s3-requests-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"ckpt-{args.params}-ws{args.world_size}"
    if not (ckpt / "latest").exists():
        t = time.monotonic()
        forge_checkpoint(
            ckpt, shapes=transformer_shapes(args.params), stage=3,
            world_size=args.world_size, dtype="bf16",
        )  # fmt: skip
        print(f"forged {ckpt} in {time.monotonic() - t:.0f} s", flush=True)
    local_out = work / "local-out"
    shutil.rmtree(local_out, ignore_errors=True)
    convert_checkpoint(str(ckpt), str(local_out), ConvertOptions())
    want = local_sha256(local_out)

    aws_home = work / "aws-home"
    aws_home.mkdir(exist_ok=True)
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    os.environ.update(aws_env(aws_home))
    proc, port = start_moto(work / "moto.log")
    endpoint = f"http://127.0.0.1:{port}"
    proxy = FaultProxy(
        upstream_port=port, latency_seconds=args.latency_ms / 1000, max_requests=10**7,
        max_seconds=10**6,
    )  # fmt: skip
    try:
        bucket = "zs-bench"
        s3_client(endpoint).create_bucket(Bucket=bucket)
        t = time.monotonic()
        src = upload_folder(endpoint, ckpt, bucket, "ckpt")
        print(f"uploaded in {time.monotonic() - t:.0f} s", flush=True)
        proxy.start()
        proxy.add(*(Fault("latency", method=m, times=10**9) for m in METHODS))
        runs = []
        for label, coalesce in (("before", False), ("after", True)):
            run = convert_once(label, coalesce, src, bucket, proxy)
            run["same_as_local"] = s3_sha256(endpoint, bucket, f"out-{label}") == want
            run["server_phases"] = server_phases(work / "moto.log", label, bucket)
            runs.append(run)
            print(json.dumps(run), flush=True)
    finally:
        proxy.stop()
        with_group(proc, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with_group(proc, signal.SIGKILL)
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    result = {
        "name": "s3-requests",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
        },
        "config": {
            "params": args.params,
            "world_size": args.world_size,
            "zero_stage": 3,
            "checkpoint_bytes": sum(p.stat().st_size for p in files),
            "latency_ms_per_request": args.latency_ms,
            "options": "ConvertOptions() defaults (staged, memory 1GB, 2 tasks)",
            "server": "moto_server on loopback behind tests/io/s3/faultproxy.py",
        },
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(summary_table(result))
    print(f"wrote {args.out}")
    return 0 if all(r["same_as_local"] for r in runs) else 1


def summary_table(result: dict[str, Any]) -> str:
    lines = [
        "| run | GETs per merge | bytes per GET (merge) | merge s | GETs in all | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        m = run["merges"]
        gets = sum(x["get_requests"] for x in m)
        got = sum(x["bytes"] for x in m)
        lines.append(
            f"| {run['label']} | {gets / max(len(m), 1):.0f} | {got / max(gets, 1) / 2**20:.2f} MiB"
            f" | {sum(x['seconds'] for x in m):.1f} | {run['get_requests']['total']} "
            f"| {run['wall_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
