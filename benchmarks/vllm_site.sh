#!/usr/bin/env bash
# vLLM 0.24.0 for the offline GPU machine (run here, at the project root): vLLM 0.22-0.24 pin torch 2.11 with CUDA 13,
# the GPU machine's own torch, so only vLLM and the libraries it imports on the serving path travel. Installed for
# Python 3.12 into one directory, packed and cut into four parts under .gpu/vllm/ (git-ignored) with their sha256;
# `bash benchmarks/h200_bench.sh vllm` there joins, checks and unpacks them. Each part is carried in a call of its
# own (see ../shared/gpu/README.md): `run(command="mkdir -p /root/draftsmith-gpu/vllm && cp .gpu/vllm/partNN
# .gpu/vllm/sha256 /root/draftsmith-gpu/vllm/", carry=[".gpu/vllm/partNN", ".gpu/vllm/sha256", ".gpu/prelude.sh"])`.
# benchmarks/vllm-gpu.txt pins what goes (vLLM's requirements and theirs). Left out, to fit: torch, triton and the
# CUDA libraries (the machine has them), flashinfer (vLLM then samples with torch: h200_bench.sh sets
# VLLM_USE_FLASHINFER_SAMPLER=0), numba (n-gram speculation only), FlashAttention 2's kernels (Hopper runs
# FlashAttention 3's), the MoE kernels and the Rust frontend; and what the machine has already (numpy, transformers,
# tokenizers, safetensors, huggingface-hub, tqdm, prometheus-client, rich, jinja2, requests, pyyaml...).
# llguidance is 1.6.1, not vLLM's pinned 1.7 (not offered here; structured output only).
set -euo pipefail
work=${WORK:-/tmp/vllm-site}
mkdir -p "$work/wheels" "$work/site" .gpu/vllm
py312=(--python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the vllm wheel by its URL (pip's resolver here does not offer 0.22-0.24), the rest as pinned in vllm-gpu.txt,
# without their dependencies (which would bring a CUDA torch here)
wheel=$(curl -sS https://pypi.org/simple/vllm/ -H "Accept: application/vnd.pypi.simple.v1+json" | python3 -c "
import json, sys
print(next(f['url'] for f in json.load(sys.stdin)['files'] if f['filename'] == 'vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl'))")
curl -sS -o "$work/wheels/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl" "$wheel"
grep -v "^vllm==" benchmarks/vllm-gpu.txt | pip download -q --no-deps -r /dev/stdin "${py312[@]}" -d "$work/wheels"
pip install -q --no-deps --no-compile --target "$work/site" "${py312[@]}" "$work"/wheels/*.whl
rm -rf "$work/site/bin" "$work/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$work/site/vllm/_moe_C_stable_libtorch.abi3.so" \
  "$work/site/vllm/vllm-rs"
tar cf - -C "$work/site" . | gzip -6 > "$work/vllm-site.tar.gz"
rm -f .gpu/vllm/part*
split -n 4 -d -a 2 "$work/vllm-site.tar.gz" .gpu/vllm/part
sha256sum "$work/vllm-site.tar.gz" | cut -c1-64 > .gpu/vllm/sha256
ls -la .gpu/vllm
