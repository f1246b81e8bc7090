#!/usr/bin/env bash
# The Llama preset against GPT-2's on one GPU, in one job: the trainer's speed (tokens/s, MFU by each model's own
# FLOPs, peak memory) side by side, a Llama SwiGLU width of a multiple of 256 with the parameter count
# kept within 1 % of GPT-2's, then where two Llama updates' GPU time goes, by kernel shape.
#
#   tools/bench/llama_speed.sh [OUT]      (OUT: results folder, default bench-out/llama; run from the repository root)
#
# Every Llama run is conf/config.yaml with the model section of conf/llama-150m.yaml, which is all that differs
# (tests/unit/test_config.py), so GPT-2 and the Llamas share the job, the records and the compile cache.
# Extra Llama runs go into LLAMA_VARIANTS, one a line, each train.py options added to the Llama preset's
# (LLAMA_VARIANTS=$'--model.n_kv_head 6 --model.intermediate_size 2432' tools/bench/llama_speed.sh).
# TRACE_CONFIGS: the configs whose updates are traced, separated by spaces (default conf/llama-150m.yaml).
set -euo pipefail
out=${1:-bench-out/llama}
mkdir -p "$out"
python=${PYTHON:-python}
llama="--model.family llama --model.n_kv_head 4 --model.intermediate_size 2496"
variants=(
  "$llama"
  # A SwiGLU width of a multiple of 256: 2560 with 3 key/value heads (127,090,176 parameters, +0.30 % against
  # GPT-2's 126,716,160; 2432 with 6 heads has as many, 2560 with 2 heads 125,910,528)
  "--model.family llama --model.n_kv_head 3 --model.intermediate_size 2560"
)
if [[ -n ${LLAMA_VARIANTS:-} ]]; then
  while IFS= read -r line; do [[ -n $line ]] && variants+=("$llama $line"); done <<< "$LLAMA_VARIANTS"
fi
variant_args=()
for v in "${variants[@]}"; do variant_args+=(--variant "$v"); done

# (a) GPT-2 (the job's own run and the plain loop) against the Llama runs, realistic documents.
"$python" -m tools bench trainer --layouts realistic --steps 25 --warmup 8 --out "$out/trainer" \
  --compile-cache "$out/compile-cache" "${variant_args[@]}" | tee "$out/trainer.txt"

# (b) Two updates of each of TRACE_CONFIGS (default: the Llama preset) under the profiler, by kernel shape.
"$python" -m tools bench synthetic-records --docs 8000 > "$out/records.jsonl"
for config in ${TRACE_CONFIGS:-conf/llama-150m.yaml}; do
  name=$(basename "$config" .yaml)
  "$python" train.py --config "$config" --microbatch 32 \
    --trainer.max_steps 15 --optim.schedule constant --observe.profile_update 12 --observe.profile_updates 2 \
    --output.root "$out/profiled-$name" \
    < "$out/records.jsonl" > "$out/profiled-$name-metrics.jsonl" 2> "$out/profiled-$name-stderr.txt"
  trace=$(ls "$out/profiled-$name"/run/profile/trace-updates-12-*.json | head -1)
  "$python" -m tools bench trace-summary "$trace" --by-shape | tee "$out/trace-summary-$name.txt"
done
