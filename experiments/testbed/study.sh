#!/usr/bin/env bash
# Mismatch testbed (one GPU): SFT the `testbed` scale's model once, then every (level, arm, seed) run as its
# own process (`triage ablate --parallel`), each stopping cleanly at BUDGET seconds (a run cut short is not
# finished: it saves a checkpoint, runs/<level>/<arm>/seed<k>/checkpoint-<step>, and its steps so far,
# runs/<level>/<arm>/seed<k>.partial.json; the next call on the same RUN_DIR continues it from there).
# Writes RUN_DIR/results.md (mean ± std over seeds per level and arm) and prints the testbed summary.
#
#   RUN_DIR=runs/testbed LEVELS="aligned pair" ARMS=grpo-none SEEDS="0 1 2" STEPS=300 BUDGET=420 \
#     bash experiments/testbed/study.sh                                      # MINI=1: smoke sizes on a CPU
#   RUN_DIR=runs/tb/long STUDY=experiments/testbed/long.yaml bash experiments/testbed/study.sh
#
# STUDY=FILE: a study file gives the levels, arms, seeds, steps, parallelism and budget (LEVELS, ARMS, SEEDS,
# STEPS, BUDGET and PARALLEL are then ignored; SET, SAVE_MODELS and MINI still apply).
# A run's seed sets `seed` (TRL's prompt order and init), `data_seed` and the sampler's generator.
# SET="learning_rate=2e-4 temperature=1.3": recipe overrides for every run (`triage ablate --set`).
# SAVE_MODELS="100 200": every run saves its learner after those steps to runs/<level>/<arm>/seed<k>/model-step<step>/
# (`triage ablate --save-models`; with STUDY it wins over the file's `save_models`).
# SFT_ONLY=1 trains (or finds) the shared checkpoint and exits (one call with all LEVELS/ARMS/SEEDS and
# PARALLEL runs them at once; several calls on one RUN_DIR would each rewrite its study.json and results).
# Levels: experiments/recipes/levels/*.yaml ("fp32 learner" = no autocast, fp32 weights and activations):
#   aligned             fp32 learner; the sampler is the learner's own model (shared), native KV cache
#   bf16-sampler        fp32 learner; a bf16 sampler copy, native KV cache
#   nvfp4-row           fp32 learner; an NVFP4 W4A4 sampler copy, per-row weight and per-token activation
#                       scales (compressed-tensors profile), native KV cache
#   nvfp4-row-fp8kv     the same with an fp8 e4m3 KV cache (the tiny preset's sampler)
#   nvfp4-tensor-fp8kv  fp32 learner; NVFP4 sampler with one tensor-wide activation amax (TE profile), fp8 KV
#   nvfp4-served-fp8kv  fp32 learner; NVFP4 sampler as a served ModelOpt checkpoint: per-tensor weight scales
#                       (one per fused q/k/v, gate/up group), calibrated static per-tensor activation scales
#                       (fixed after the first batch), fp8 KV
#   nvfp4-coarse-fp8kv  deliberately larger: 16x16 scale tiles, tensor amax, stochastic rounding, fp8 KV
#   pair                NVFP4 learner (TE, tensor-wide amax) vs the tiny preset's NVFP4 sampler, no autocast
#   pair-row            NVFP4 learner on the sampler's own recipe (per-row/per-token) vs the same sampler
#   realistic           the tiny preset as shipped (NVFP4 learner under bf16 autocast)
set -u
R=${RUN_DIR:-runs/testbed}
STEPS=${STEPS:-300}
BUDGET=${BUDGET:-100000}
MINI=${MINI:+--mini}
LEVELS=${LEVELS:-aligned bf16-sampler nvfp4-row nvfp4-row-fp8kv nvfp4-tensor-fp8kv pair realistic}
ARMS=${ARMS:-grpo-none}
SEEDS=${SEEDS:-0}
read -ra L <<<"$LEVELS"; read -ra A <<<"$ARMS"; read -ra S <<<"$SEEDS"
PARALLEL=${PARALLEL:-$(( ${#L[@]} * ${#A[@]} * ${#S[@]} ))}   # default: every run at once
join() { local IFS=,; echo "$*"; }
if [ -n "${SFT_ONLY:-}" ]; then
  python -c "
import sys
from triage.experiments.ablate import SCALES, SFT_DIR, mini
from triage.experiments.sft import ensure_sft_checkpoint
p = SCALES['testbed']
ensure_sft_checkpoint((mini(p) if sys.argv[1] else p).sft, sys.argv[2] + '/' + SFT_DIR)
" "$MINI" "$R"
  exit $?
fi
if [ -n "${STUDY:-}" ]; then
  # shellcheck disable=SC2086
  python -m triage ablate --study "$STUDY" $MINI --output "$R" --resume --no-plots ${SET:+--set $SET} \
    ${SAVE_MODELS:+--save-models "$(join $SAVE_MODELS)"}
else
  # shellcheck disable=SC2086
  python -m triage ablate --scale testbed $MINI --output "$R" --levels "$(join "${L[@]}")" \
    --arms "$(join "${A[@]}")" --seeds "$(join "${S[@]}")" --steps "$STEPS" --parallel "$PARALLEL" \
    --time-budget "$BUDGET" --resume --no-plots ${SET:+--set $SET} \
    ${SAVE_MODELS:+--save-models "$(join $SAVE_MODELS)"}
fi
python -m triage.experiments.testbed_summary "$R"
