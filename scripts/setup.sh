#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with zerosafe, its tests' dependencies and
# DeepSpeed (the test oracle). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
# torch first, pinned: an unpinned torch would pull several GB of CUDA wheels.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[test,s3,dask,dev,fast]'
# DeepSpeed (tests only) is a source package that needs torch at build time.
if ! .venv/bin/python -c 'import deepspeed' 2>/dev/null; then
    DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation deepspeed==0.19.8
fi
# The frameworks whose own save code writes some test checkpoints (accelerate, peft,
# OLMo-core). Their metadata asks for older filelock/rich/huggingface-hub than the suite
# runs with, which pip's resolver cannot satisfy; they work with ours, so they go in
# without it, pinned by constraints.txt, with the modules their import paths need.
"${PIP[@]}" --no-deps accelerate peft ai2-olmo-core cached-path bettermap \
    dataclass-extensions importlib-resources pandas dill
"${PIP[@]}" google-cloud-storage  # cached-path imports it at import time
# verl (tests only: its checkpoint manager writes the verl fixtures) without its dependencies:
# its metadata pins transformers<5.11 and pulls Ray, which its checkpoint code does not use.
"${PIP[@]}" --no-deps verl==0.9.1
# ByteCheckpoint (tests only: its own save writes the ByteCheckpoint fixtures) without its
# dependencies: its metadata pins torch<=2.5 and protobuf 3.20, yet its save runs with ours;
# its import needs grpcio (pinned, as it asks) and nothing else we lack.
"${PIP[@]}" --no-deps bytecheckpoint==0.0.2 grpcio==1.69.0
# torch_checkpointing (tests only: its CheckpointManager writes the torch_checkpointing fixtures);
# pure Python, and its metadata asks for nothing the suite lacks.
"${PIP[@]}" --no-deps torch-checkpointing==0.1.1
.venv/bin/zerosafe --version
