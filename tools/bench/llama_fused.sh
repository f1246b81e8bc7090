#!/usr/bin/env bash
# The Llama preset's plain path against each field library's fused RMSNorm and SwiGLU, and GPT-2, on one GPU in
# one job: the trainer's tokens/s, MFU (by each model's own FLOPs) and peak memory side by side.
#
#   tools/bench/llama_fused.sh [OUT]      (OUT: results folder, default bench-out/llama-fused; from the repository root)
#
# Runs (realistic documents, the same records and compile cache): GPT-2 (conf/config.yaml, and the plain loop of
# `bench trainer`), the Llama preset (the model section of conf/llama-150m.yaml) plain, with Liger's RMSNorm and
# SwiGLU (compute.norm liger, compute.mlp liger; liger-kernel), with Liger's RMSNorm alone, and with quack's
# RMSNorm (compute.norm quack; quack-kernels, Hopper or Blackwell). A library that cannot run here is left out, with
# its reason on stderr (a kernel asked for by name must run, or train.py stops). Extra runs: FUSED_VARIANTS, one a
# line, each train.py options added to the Llama preset's.
set -euo pipefail
out=${1:-bench-out/llama-fused}
mkdir -p "$out"
python=${PYTHON:-python}
llama="--model.family llama --model.n_kv_head 4 --model.intermediate_size 2496"
problem() {  # why the library $1's kernels cannot run on this GPU, or nothing
  "$python" -c "import torch; from model.kernels import llama_fused as f
p = f.unavailable_reason('$1', torch.device('cuda'), torch.bfloat16); print(p or '', end='')"
}
variants=("$llama")
liger=$(problem liger)
if [[ -z $liger ]]; then
  variants+=("$llama --compute.norm liger --compute.mlp liger" "$llama --compute.norm liger")
else
  echo "liger left out: $liger" >&2
fi
quack=$(problem quack)
if [[ -z $quack ]]; then variants+=("$llama --compute.norm quack"); else echo "quack left out: $quack" >&2; fi
if [[ -n ${FUSED_VARIANTS:-} ]]; then
  while IFS= read -r line; do [[ -n $line ]] && variants+=("$llama $line"); done <<< "$FUSED_VARIANTS"
fi
variant_args=()
for v in "${variants[@]}"; do variant_args+=(--variant "$v"); done
"$python" -m tools bench trainer --layouts realistic --steps 20 --warmup 6 --out "$out" \
  --compile-cache "$out/compile-cache" "${variant_args[@]}" | tee "$out/trainer.txt"
