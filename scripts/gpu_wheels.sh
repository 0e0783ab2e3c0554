#!/usr/bin/env bash
# Wheels the GPU machine lacks, for scripts/gpu_check.py (see its docstring), and the size check of what the device
# call carries. DeepSpeed is built from its sdist here (pure Python, py3-none-any; its ops are JIT-compiled on first
# use, and the recipe's configs use none: torch_adam). The rest are downloaded for the device's CPython 3.12 on
# x86-64 (manylinux). The device image already has torch, transformers, safetensors, accelerate, rich, pyarrow,
# pandas, xxhash, fsspec, huggingface-hub, pyyaml, msgpack, einops, psutil, py-cpuinfo, ninja, tqdm and packaging;
# it lacks hjson, pydantic (+ pydantic-core, annotated-types, typing-inspection), datasets, dill and multiprocess,
# and gguf (pure Python: transformers' GGUF reader, for scripts/gpu_demo.py's conversion of the SmolLM2 target).
# typing-extensions travels too: pydantic-core needs >= 4.16 and the image's version is not known here.
# SpecForge 0.2.0 (pure Python) travels for scripts/gpu_perf_check.py, which times its draft step beside ours:
# installed --no-deps like the rest (its sglang, yunchang, wandb... are not needed by the modules the adapter imports,
# scripts/gpu_perf_specforge.py); its sha256 is checked below.
# Versions: deepspeed and datasets as pyproject.toml pins them, the others as this venv has them (the versions the
# tests pass with). Keep one version of each: two stop the device's install.
#   usage: bash scripts/gpu_wheels.sh [DIR]      (default .whl; git-ignored; name it in the device call's carry)
# Then it checks that the tree that travels (tracked + untracked-not-ignored files) plus DIR and .gpu_assets (if
# present) fits the device call's 64 MiB, and fails (exit 1) when it does not (scripts/gpu_demo.py --prepare checks
# its own two calls, .gpu_demo with DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
py="${PYTHON:-.venv/bin/python}"
limit=$((64 * 1024 * 1024))
mkdir -p "$dir"
rm -f "$dir"/*.whl
"$py" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$dir"
pins=$("$py" - <<'EOF'
from importlib.metadata import version
fixed = {"datasets": "5.2.0", "specforge": "0.2.0"}
names = ["hjson", "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions", "dill",
         "multiprocess", "gguf"]
print(" ".join([f"{n}=={v}" for n, v in fixed.items()] + [f"{n}=={version(n)}" for n in names]))
EOF
)
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" $pins
sf_sha=fbc79517adf483c6a8beea52561b1a8c8c8a99a54c820b47d2033a73966b55b0
echo "$sf_sha  $dir/specforge-0.2.0-py3-none-any.whl" | sha256sum -c --quiet - \
    || { echo "specforge wheel: not the one scripts/gpu_perf_specforge.py was written against" >&2; exit 1; }
ls -l "$dir"
# The travelling size: every file git would send (tracked, and untracked but not ignored) plus the carried folders.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -L -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
carried=0
for c in "$dir" .gpu_assets; do
    [ -d "$c" ] && carried=$((carried + $(find "$c" -type f -printf '%s\n' | awk '{s+=$1} END {print s+0}')))
done
total=$((tree + carried))
printf 'travels: tree %.1f MiB + carried (%s, .gpu_assets) %.1f MiB = %.1f MiB of %d MiB\n' \
    "$(echo "$tree / 1048576" | bc -l)" "$dir" "$(echo "$carried / 1048576" | bc -l)" \
    "$(echo "$total / 1048576" | bc -l)" $((limit / 1048576))
if [ "$total" -gt "$limit" ]; then
    echo "too large for one device call: carry less" >&2
    exit 1
fi
