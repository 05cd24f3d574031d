#!/usr/bin/env bash
# Mismatch-testbed pilot (one GPU): SFT the `testbed` preset's model once, then STEPS vanilla-GRPO steps at
# every candidate learner/sampler mismatch level, all levels as parallel processes. Prints, per level, the
# measured mean |δ| over the first steps and the seconds per step: what the dose-response study is sized by.
#
#   RUN_DIR=runs/testbed STEPS=5 bash experiments/testbed/pilot.sh        # MINI=1: smoke sizes on a CPU
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
STEPS=${STEPS:-5}
MINI=${MINI:+--mini}
LEVELS=${LEVELS:-aligned bf16-sampler nvfp4-row nvfp4-row-fp8kv nvfp4-tensor-fp8kv pair pair-bf16}
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
for lvl in $LEVELS; do
  mkdir -p "$R/$lvl" && ln -sfn ../sft "$R/$lvl/sft"
  # shellcheck disable=SC2086
  python -m triage ablate --preset testbed $MINI --arms grpo-none --no-plots --steps "$STEPS" \
    --output "$R/$lvl" ${LEVEL[$lvl]} >"$R/$lvl.log" 2>&1 &
done
wait
python - "$R" $LEVELS <<'PY'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
print(f"{'level':20s} {'|δ| step 1':>10s} {'|δ| mean':>9s} {'reward':>7s} {'s/step':>7s}")
for lvl in sys.argv[2:]:
    f = root / lvl / "arms" / "grpo-none.json"
    if not f.is_file():
        print(f"{lvl:20s} FAILED: see {lvl}.log"); continue
    e = json.loads(f.read_text()); s = e["series"]; d = [x for x in s["mean_abs_delta"] if x is not None]
    print(f"{lvl:20s} {d[0]:10.5f} {sum(d)/len(d):9.5f} {sum(s['reward'])/len(s['reward']):7.3f} "
          f"{e['seconds']/len(s['step']):7.2f}")
PY
