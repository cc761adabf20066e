"""Copy a results file into bench/reported/ without the bulky per-run command output.

.venv/bin/python bench/_publish.py bench/results/quick.json [...]
"""

from __future__ import annotations

import json
import os
import sys

REPORTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reported")


def main(paths: list[str]) -> int:
    os.makedirs(REPORTED, exist_ok=True)
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        for run in result.get("runs", []):
            for key in ("stdout", "stderr"):
                run.pop(key, None)
        dest = os.path.join(REPORTED, os.path.basename(path))
        with open(dest, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{dest}: {os.path.getsize(dest)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
