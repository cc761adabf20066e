"""Run a conversion in this process while a thread samples its RSS; print JSON.

    python tests/memory_probe.py engine|flow CKPT OUT OPTIONS_JSON

With `ZEROSAFE_PROBE_WARM=URL` (a small checkpoint on the same object store as CKPT), it also
converts that before taking the baseline, so the store's client libraries are not counted.

First converts the shipped sample (so every lazy import and allocator warm-up is done), takes
the RSS then as the baseline, and reports the peak RSS of the real conversion above it.
Separate from pytest so the peak is this process's own (ru_maxrss would be inherited).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.rss import PeakRSS  # noqa: E402


def main() -> None:
    kind, ckpt, out, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    if kind == "engine":
        from zerosafe.config import ConvertOptions
        from zerosafe.driver import convert_checkpoint

        def run(src: str, dst: str) -> dict:
            return convert_checkpoint(src, dst, ConvertOptions(**options)).to_json()
    else:
        from zerosafe_app.flows.runtime import configure_embedded_prefect

        configure_embedded_prefect()
        from zerosafe_app.flows.convert import convert

        def run(src: str, dst: str) -> dict:
            return convert(source=src, destination=dst, **options)

    with tempfile.TemporaryDirectory() as warm:
        run(str(REPO / "examples" / "zero3-bf16-ws3"), os.path.join(warm, "o"))
    warm_url = os.environ.get("ZEROSAFE_PROBE_WARM")
    if warm_url:  # an object-store run: load its client stack (s3fs, botocore) before the baseline
        run(warm_url, warm_url.rstrip("/") + "-out")
    with PeakRSS(every_s=0.005) as m:
        summary = run(ckpt, out)
    print(
        json.dumps(
            {
                "baseline_rss": m.baseline,
                "peak_rss": m.peak,
                "seconds": m.seconds,
                "status": summary["status"],
            }
        )
    )


if __name__ == "__main__":
    main()
