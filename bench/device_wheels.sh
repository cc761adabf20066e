#!/usr/bin/env bash
# Run HERE (where pip reaches PyPI), before a device run: puts in .whl/ what bench/device_check.sh
# needs on the GPU machine beyond its image (Python 3.12, torch 2.11 with CUDA, numpy, pyarrow,
# safetensors, fsspec, psutil, xxhash, ml-dtypes...; /work/.library/device/KINDS.md lists it):
# DeepSpeed 0.19.8 as a pure-Python wheel built here (DS_BUILD_OPS=0: it JIT-builds nothing when
# the resume uses torch's AdamW) and the dependencies of it the image lacks, and py-spy for
# bench/device_command.sh's profiles. Then carry `.whl`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .whl && mkdir -p .whl
DS_BUILD_OPS=0 .venv/bin/python -m pip wheel --quiet --no-deps --no-build-isolation \
    -w .whl deepspeed==0.19.8
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
    typing-inspection==0.4.5 zlib-ng==1.1.0 py-spy==0.4.3
ls -la .whl
