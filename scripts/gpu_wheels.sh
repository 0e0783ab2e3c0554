#!/usr/bin/env bash
# Wheels the GPU machine lacks, for scripts/gpu_check.py (see its docstring): DeepSpeed built from its sdist here
# (pure Python, py3-none-any; its ops JIT-compile on first use with the device's ninja), and DeepSpeed's and the
# e2e stages' other missing packages downloaded for the device's CPython 3.12 on x86-64. The device image already
# has torch, transformers, safetensors, rich, pyarrow, pandas, xxhash, fsspec, msgpack, einops, psutil, py-cpuinfo,
# ninja and tqdm. Versions: those pyproject.toml pins, else the ones this venv has.
#   usage: bash scripts/gpu_wheels.sh [DIR]      (default .whl; add it to .git/info/exclude and name it in carry)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
py="${PYTHON:-.venv/bin/python}"
mkdir -p "$dir"
rm -f "$dir"/*.whl
"$py" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
    hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
du -sh "$dir"
ls "$dir"
