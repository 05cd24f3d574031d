#!/usr/bin/env bash
# Mismatch testbed (one GPU): SFT the `testbed` preset's model once, then every (level, arm, seed) run as its
# own process, all in parallel, each stopping cleanly at BUDGET seconds (its JSON then says complete: false).
# Prints mean ± std over seeds per (level, arm): mean |δ| (step 1, run), reward and held-out accuracy (first
# and last), entropy, steps done and seconds per step.
#
#   RUN_DIR=runs/testbed LEVELS="aligned pair" ARMS=grpo-none SEEDS="0 1 2" STEPS=300 BUDGET=420 \
#     bash experiments/testbed/study.sh                                      # MINI=1: smoke sizes on a CPU
#
# A run's seed sets `seed` (TRL's prompt order and init), `data_seed` and the sampler's generator.
# SFT_ONLY=1 trains (or finds) the shared checkpoint and exits, so several study.sh with other LEVELS/ARMS can
# then share one RUN_DIR in parallel.
#
# Levels (`--set` overrides of the tiny recipe; "fp32 learner" = no autocast, fp32 weights and activations):
#   aligned             fp32 learner; the sampler is the learner's own model (shared), native KV cache
#   bf16-sampler        fp32 learner; a bf16 sampler copy, native KV cache
#   nvfp4-row           fp32 learner; an NVFP4 W4A4 sampler copy, per-token activation scales
#                       (compressed-tensors profile), native KV cache
#   nvfp4-row-fp8kv     the same with an fp8 e4m3 KV cache (the tiny preset's sampler)
#   nvfp4-tensor-fp8kv  fp32 learner; NVFP4 sampler with one tensor-wide activation amax (TE profile), fp8 KV
#   pair                NVFP4 learner (TE, tensor-wide amax) vs the tiny preset's NVFP4 sampler, no autocast
#   pair-bf16           the tiny preset as shipped (NVFP4 learner under bf16 autocast)
set -u
R=${RUN_DIR:-runs/testbed}
STEPS=${STEPS:-300}
BUDGET=${BUDGET:-100000}
MINI=${MINI:+--mini}
LEVELS=${LEVELS:-aligned bf16-sampler nvfp4-row nvfp4-row-fp8kv nvfp4-tensor-fp8kv pair pair-bf16}
ARMS=${ARMS:-grpo-none}
SEEDS=${SEEDS:-0}
FP32="--set bf16=false --set learner_precision=bf16 --set quant_recipe=null"
NOKV="--set sampler_kwargs.kv_cache_dtype=null"
declare -A LEVEL=(
  [aligned]="$FP32 $NOKV --set sampler_kwargs.sampler_model=shared --set sampler_kwargs.precision=null --set sampler_kwargs.quant_recipe=null"
  [bf16-sampler]="$FP32 $NOKV --set sampler_kwargs.precision=bf16 --set sampler_kwargs.quant_recipe=null"
  [nvfp4-row]="$FP32 $NOKV"
  [nvfp4-row-fp8kv]="$FP32"
  [nvfp4-tensor-fp8kv]="$FP32 --set sampler_kwargs.quant_recipe.scale=tensor --set sampler_kwargs.quant_recipe.profile=te"
  [pair]="--set bf16=false"
  [pair-bf16]=""
)
mkdir -p "$R"
python -c "
import sys
from triage.experiments.ablate import PRESETS, mini
from triage.experiments.sft import ensure_sft_checkpoint
p = PRESETS['testbed']
ensure_sft_checkpoint((mini(p) if sys.argv[1] else p).sft, sys.argv[2])
" "$MINI" "$R/sft" || exit 1
[ -n "${SFT_ONLY:-}" ] && exit 0   # SFT_ONLY=1: only the shared checkpoint (then several study.sh at once)
for lvl in $LEVELS; do for arm in $ARMS; do for seed in $SEEDS; do
  d="$R/$lvl/$arm/s$seed"
  mkdir -p "$d" && ln -sfn "$(cd "$R" && pwd)/sft" "$d/sft"
  # shellcheck disable=SC2086
  python -m triage ablate --preset testbed $MINI --arms "$arm" --no-plots --steps "$STEPS" --output "$d" \
    --time-budget "$BUDGET" --set seed="$seed" --set data_seed="$seed" --set sampler_kwargs.seed="$seed" \
    ${LEVEL[$lvl]} >"$d/run.log" 2>&1 &
done; done; done
wait
python -m triage.experiments.testbed_summary "$R"
