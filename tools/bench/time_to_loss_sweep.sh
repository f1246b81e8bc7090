#!/usr/bin/env bash
# conf/fast-150m.yaml and one change to it at a time, raced against the lab's recipe (conf/config.yaml) in one
# time-to-loss job on the C/C++ headers: the same rows and validation file for every run, so that each ingredient
# is kept only where it reaches the reference's final validation cross-entropy sooner in GPU-seconds.
#
#   tools/bench/time_to_loss_sweep.sh [OUT] [PART]     (run from the repository root)
#
# OUT: results folder (default bench-out/time-to-loss-sweep): time-to-loss.json (rewritten after every run, so a
# job stopped early keeps the runs it finished), time-to-loss.png, each run's folder and stderr log.
# PART: all (default), 1 to 5. 1 and 2 split the candidates over two jobs, each with the reference and the preset
# as it is, for a machine whose time per command is shorter than the whole sweep. 3: the ingredients together
# (qk_norm, zero_init_proj, untied head), with and without the higher learning rates, over 150, 50 and 35 updates.
# 4: the preset's warmup: the preset as it is, then optim.warmup_steps 5 over 150, 50 and 40 updates, and over 40
# updates with optim.muon_lr 0.04. 5: the preset as it is, without QK-norm, and with a tied head (run it with
# CORPUS=python as the second corpus).
# The candidates, in this order (PART 1: the first four, PART 2: the preset and the last four):
#   the preset as it is; + model.qk_norm; + model.zero_init_proj; + an untied head (model.tie_embeddings false);
#   + optim.muon_lr 0.03 with model.qk_norm; + optim.embed_lr at 10 x the preset's optim.lr; all of these at once;
#   the preset with a third of the updates (trainer.max_steps STEPS/3, so its wsd decay ends sooner).
# Environment: PYTHON (default python), PRESET (default conf/fast-150m.yaml), REFERENCE (default conf/config.yaml),
# STEPS (default 150), CORPUS (default headers), and EXTRA: options for every run of the job (default --every 5).
# The same sweep on a CPU at tiny scale: PRESET=conf/fast-smoke.yaml REFERENCE=conf/smoke.yaml STEPS=6
# EXTRA="--microbatch 8 --every 2 --model.max_seq_len 64 --optim.warmup_steps 1 --val-tokens 20000".
set -euo pipefail
out=${1:-bench-out/time-to-loss-sweep}
part=${2:-all}
python=${PYTHON:-python}
preset=${PRESET:-conf/fast-150m.yaml}
reference=${REFERENCE:-conf/config.yaml}
steps=${STEPS:-150}
corpus=${CORPUS:-headers}
read -r -a extra <<< "${EXTRA:---every 5}"

lr=$("$python" -c "import sys; from config import load_config; print(load_config(sys.argv[1]).optim.lr)" "$preset")
embed_lr=$("$python" -c "import sys; print(f'{10 * float(sys.argv[1]):.6g}')" "$lr")
fast="--config $preset"
all_at_once="--model.qk_norm true --model.zero_init_proj true --model.tie_embeddings false --optim.muon_lr 0.03"
all_at_once+=" --optim.embed_lr $embed_lr"
as_is="$fast"
first=(
  "$fast --model.qk_norm true"
  "$fast --model.zero_init_proj true"
  "$fast --model.tie_embeddings false"
)
second=(
  "$fast --model.qk_norm true --optim.muon_lr 0.03"
  "$fast --optim.embed_lr $embed_lr"
  "$fast $all_at_once"
  "$fast --trainer.max_steps $((steps / 3))"
)
all_of_them="$fast --model.qk_norm true --model.zero_init_proj true --model.tie_embeddings false"
third=(
  "$all_of_them --optim.muon_lr 0.03 --optim.embed_lr $embed_lr"
  "$all_of_them --optim.muon_lr 0.03 --optim.embed_lr $embed_lr --trainer.max_steps $((steps / 3))"
  "$all_of_them --optim.muon_lr 0.03 --optim.embed_lr $embed_lr --trainer.max_steps $((steps * 7 / 30))"
  "$all_of_them"
  "$all_of_them --trainer.max_steps $((steps / 3))"
)
fourth=(
  "$fast"
  "$fast --optim.warmup_steps 5"
  "$fast --optim.warmup_steps 5 --trainer.max_steps $((steps / 3))"
  "$fast --optim.warmup_steps 5 --trainer.max_steps $((steps * 4 / 15))"
  "$fast --optim.warmup_steps 5 --trainer.max_steps $((steps * 4 / 15)) --optim.muon_lr 0.04"
)
fifth=(
  "$fast"
  "$fast --model.qk_norm false"
  "$fast --model.tie_embeddings true"
)
case $part in
  all) candidates=("$as_is" "${first[@]}" "${second[@]}") ;;
  1) candidates=("$as_is" "${first[@]}") ;;
  2) candidates=("$as_is" "${second[@]}") ;;
  3) candidates=("${third[@]}") ;;
  4) candidates=("${fourth[@]}") ;;
  5) candidates=("${fifth[@]}") ;;
  *) echo "time_to_loss_sweep.sh: PART must be all, 1, 2, 3, 4 or 5, not $part" >&2; exit 2 ;;
esac
candidate_args=()
for c in "${candidates[@]}"; do candidate_args+=(--candidate "$c"); done
mkdir -p "$out"
"$python" -m tools bench time-to-loss --corpus "$corpus" --steps "$steps" --config "$reference" "${extra[@]}" \
  --out "$out" "${candidate_args[@]}"
