#!/usr/bin/env bash
# One GPU call of the mismatch testbed: install the package (and the carried .whl/ wheels), optionally start
# CUDA MPS, run every SPEC at once (each a line of environment assignments for experiments/testbed/study.sh,
# so each SPEC is its own `triage ablate --parallel` study in its own RUN_DIR), then pack every study's runs
# (JSON, logs, results.md) into $OUT/testbed-runs.tgz.
#
#   MPS=1 bash experiments/testbed/gpu.sh \
#     "RUN_DIR=/tmp/tb/base LEVELS='aligned pair' SEEDS='0 1 2' STEPS=300 BUDGET=480" \
#     "RUN_DIR=/tmp/tb/lr2e-4 LEVELS=aligned SET=learning_rate=2e-4 STEPS=300 BUDGET=480"
#
# Runs longer than one call: give a RUN_DIR under the repository (runs/..., git-ignored, so a machine that
# is still warm keeps it between two calls) and call again; every run the budget cut short continues from its
# checkpoint (RUN_DIR/runs/<level>/<arm>/seed<k>/checkpoint-<step>, left out of the tarball: model + AdamW are
# too large to bring back). On a fresh machine the checkpoints are gone and such a run starts again from step
# 0 (its log says which). A study file instead of LEVELS/ARMS/SEEDS/STEPS/BUDGET:
#   MPS=1 bash experiments/testbed/gpu.sh "RUN_DIR=runs/tb/long STUDY=experiments/testbed/long.yaml"
#
# Saved models (`save_models` in a study file, SAVE_MODELS="100 200" in a spec): every run's learner after
# those steps, RUN_DIR/runs/<level>/<arm>/seed<k>/model-step<step>/ (an HF folder: weights and tokenizer), also
# stays on the machine (left out of the tarball, as are all *.safetensors). Analyse it in the same `run`
# command, after gpu.sh, and bring back what the analysis writes to $OUT, e.g.
#   MPS=1 bash experiments/testbed/gpu.sh "RUN_DIR=runs/tb/lp STUDY=experiments/testbed/learner-precision.yaml"
#   python3 experiments/testbed/delta_decomposition.py --model runs/tb/lp/runs/pair-row/grpo-none/seed2/model-step100 \
#     --temperature 1.3 --json $OUT/decomp-pair-row-s2.json
# (learner-precision.yaml's header has the full command); a later call on the same warm machine finds them too.
#
# A carried .sftcache/sft (a finished SFT checkpoint of the testbed scale) is copied into each RUN_DIR/sft,
# so no call repeats the SFT. MPS=1: the parallel runs are many small processes on one GPU; without MPS their
# kernels time-slice (one process at a time), with it they run concurrently. Each testbed run holds up to ~4.7 GB of
# GPU memory: 18 at once did not fit an 80 GB H100 (two failed with CUDA out of memory at start); keep a
# call to 16 runs (~75 GB) or fewer. If the MPS daemon does not come
# up (or a CUDA client cannot attach within 60 s) the call goes on without it and says so.
set -u
export PYTHONUNBUFFERED=1
REAL_OUT=${OUT:-/tmp/testbed-out}; mkdir -p "$REAL_OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, trl; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__)"
mps_stop() { [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | timeout 20 nvidia-cuda-mps-control; }
if [ -n "${MPS:-}" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d && timeout 60 python3 -c "import torch; assert torch.ones(4, device='cuda').sum().item() == 4"; then
    echo "MPS: on"
  else
    echo "MPS: unavailable, running without it"; cat "$CUDA_MPS_LOG_DIRECTORY"/* 2>/dev/null | tail -5
    mps_stop; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
# The testbed SFT once per call, not once per spec: a carried .sftcache/sft is used as is; without one it is
# trained here and brought back as $OUT/sft.tgz.part-* (split under the 16 MiB a returned file may have;
# reassemble with `cat sft.tgz.part-* | tar xz -C .sftcache`) so the next calls start from the same checkpoint.
if [ ! -d .sftcache/sft ]; then
  RUN_DIR=.sftcache SFT_ONLY=1 bash experiments/testbed/study.sh 2>&1 | tail -n 5
  tar czf - -C .sftcache sft | split -b 15M - "$REAL_OUT/sft.tgz.part-"
fi
pids=(); dirs=()
for spec in "$@"; do
  dir=$(eval "$spec"; echo "${RUN_DIR:-runs/testbed}")
  dirs+=("$dir"); mkdir -p "$dir"
  [ -d .sftcache/sft ] && [ ! -d "$dir/sft" ] && cp -r .sftcache/sft "$dir/sft"
  (eval "export $spec"; bash experiments/testbed/study.sh >"$dir/study.log" 2>&1) &
  pids+=($!)
  echo "started: $spec"
done
for pid in "${pids[@]}"; do wait "$pid"; done
mps_stop
for dir in "${dirs[@]}"; do echo "=== $dir"; tail -n 40 "$dir/study.log"; done
# RUN_DIR/sft comes back without its weights: its sft.json names the checkpoint, which testbed_summary
# checks before it reads runs of several calls or files as one study
tar czf "$REAL_OUT/testbed-runs.tgz" --exclude='*/checkpoint-*' --exclude='*/model-step*' \
  --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' "${dirs[@]}" 2>/dev/null
ls -la "$REAL_OUT"
