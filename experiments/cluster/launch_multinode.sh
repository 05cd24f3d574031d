#!/usr/bin/env bash
# Launch a triage-rl recipe on a GPU cluster: N training nodes (accelerate or torchrun) + 1 sampler node
# running `trl vllm-serve` (TRL's server mode: the trainer sends prompts and NCCL weight updates to it).
# Step by step: experiments/cluster/README.md and docs/experiments.md.
#
#   SLURM:   sbatch --nodes=$((TRAIN_NODES + 1)) --gpus-per-node=8 --ntasks-per-node=1 --exclusive \
#              experiments/cluster/launch_multinode.sh qwen3-4b/triage [--set KEY=VALUE ...]
#            (the last node of the allocation serves vLLM, the others train)
#   manual:  on the sampler node:          ROLE=vllm  launch_multinode.sh RECIPE
#            on training node r = 0..N-1:  ROLE=train NODE_RANK=r MASTER_ADDR=<node 0> VLLM_HOST=<sampler> \
#                                          launch_multinode.sh RECIPE
#   single:  one node, vLLM on the first VLLM_GPUS GPUs, training on the rest:
#            MODE=single VLLM_GPUS=4 launch_multinode.sh RECIPE
#
# Environment (all optional unless stated):
#   MODE          slurm | manual | single       (default: slurm inside a SLURM job, else manual)
#   ROLE          manual mode: vllm | train     (required in manual mode)
#   LAUNCHER      accelerate | torchrun         (default accelerate; torchrun only with the DDP config)
#   RUN_DIR       shared output folder; recipe.yaml lands here (default runs/<recipe>-<date>; required in
#                 manual mode, where every node must name the same folder)
#   MASTER_PORT   rendezvous port               (default 29500)
#   VLLM_PORT     vLLM server port              (default: the recipe's vllm_server_port, else 8000)
#   VLLM_GPUS     single mode: GPUs for vLLM    (default 4)
#   NUM_GPUS      single mode: GPUs on the node (default: nvidia-smi -L)
#   DRY_RUN=1     print the commands instead of running them
set -euo pipefail

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $# -ge 1 && $1 != -h && $1 != --help ]] || usage
RECIPE=$1; shift
OVERRIDES=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --set) OVERRIDES+=(--set "$2"); shift 2 ;;
    --set=*) OVERRIDES+=(--set "${1#--set=}"); shift ;;
    *) echo "launch_multinode.sh: unknown argument $1" >&2; usage ;;
  esac
done

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ACCELERATE_DIR=$(cd "$HERE/../accelerate" && pwd)
PYTHON=${PYTHON:-python}
if [[ -n ${SLURM_JOB_ID:-} ]]; then MODE=${MODE:-slurm}; else MODE=${MODE:-manual}; fi
LAUNCHER=${LAUNCHER:-accelerate}
MASTER_PORT=${MASTER_PORT:-29500}
STAMP=$(date +%Y%m%d-%H%M%S)
if [[ $MODE == manual && -z ${RUN_DIR:-} ]]; then  # each node would pick its own timestamped folder
  echo "manual mode needs RUN_DIR (the same shared folder on every node)" >&2; exit 2
fi
RUN_DIR=${RUN_DIR:-runs/$(echo "$RECIPE" | tr '/.' '--')-$STAMP}

run() {  # print, then run unless DRY_RUN
  printf '+ %s\n' "$*" >&2
  if [[ ${DRY_RUN:-0} != 1 ]]; then "$@"; fi
}

run_logged() {  # $1 = log file; print, then run the rest in the background with output to the log
  local log=$1; shift
  printf '+ %s > %s &\n' "$*" "$log" >&2
  if [[ ${DRY_RUN:-0} != 1 ]]; then "$@" > "$log" 2>&1 & fi
}

# --- nodes -------------------------------------------------------------------------------------------------
case $MODE in
  slurm)
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    [[ ${#NODES[@]} -ge 2 ]] || { echo "need >= 2 nodes (training + vLLM), got ${#NODES[@]}" >&2; exit 2; }
    VLLM_HOST=${NODES[-1]}
    TRAIN_NODES_LIST=("${NODES[@]:0:${#NODES[@]}-1}")
    MASTER_ADDR=${TRAIN_NODES_LIST[0]}
    ;;
  manual)
    [[ ${ROLE:-} == vllm || ${ROLE:-} == train ]] || { echo "manual mode needs ROLE=vllm or ROLE=train" >&2; exit 2; }
    if [[ $ROLE == train ]]; then
      : "${NODE_RANK:?manual training needs NODE_RANK}" "${MASTER_ADDR:?manual training needs MASTER_ADDR}"
      : "${VLLM_HOST:?manual training needs VLLM_HOST (the sampler node)}"
    else
      VLLM_HOST=${VLLM_HOST:-$(hostname)}
    fi
    ;;
  single)
    VLLM_HOST=127.0.0.1
    MASTER_ADDR=127.0.0.1
    ;;
  *) echo "MODE must be slurm, manual or single, got $MODE" >&2; exit 2 ;;
esac

# --- the resolved recipe (validated; written once, read by every node from the shared RUN_DIR) --------------
mkdir -p "$RUN_DIR"
SERVER_OVERRIDES=(--set "vllm_server_host=$VLLM_HOST" --set "output_dir=$RUN_DIR")
if [[ -n ${VLLM_PORT:-} ]]; then SERVER_OVERRIDES+=(--set "vllm_server_port=$VLLM_PORT"); fi
# Every node resolves the same recipe (deterministic); the training processes read $RUN_DIR/recipe.yaml.
printf '+ %s\n' "$PYTHON -m triage.experiments.recipes $RECIPE ${OVERRIDES[*]} ${SERVER_OVERRIDES[*]} -o $RUN_DIR/recipe.yaml" >&2
"$PYTHON" -m triage.experiments.recipes "$RECIPE" "${OVERRIDES[@]}" "${SERVER_OVERRIDES[@]}" \
  -o "$RUN_DIR/recipe.yaml"

# Shell variables from the recipe's launch section (model, layout, accelerate config, vLLM arguments).
eval "$("$PYTHON" - "$RUN_DIR/recipe.yaml" "$ACCELERATE_DIR" <<'EOF'
import shlex, sys
from pathlib import Path
import yaml
recipe = yaml.safe_load(open(sys.argv[1]))
launch = recipe.get("launch") or {}
acc = launch.get("accelerate_config", "ddp")
acc_path = Path(sys.argv[2]) / f"{acc}.yaml"
serve = dict(launch.get("vllm_serve") or {})
flags = []
for key, value in serve.items():
    if isinstance(value, bool):
        value = str(value).lower()
    flags += [f"--{key}", str(value)]
out = {
    "MODEL": recipe["model_name_or_path"],
    "TRAIN_NODES": launch.get("train_nodes", 1),
    "GPUS_PER_NODE": launch.get("gpus_per_node", 8),
    "ACCELERATE_NAME": acc,
    "ACCELERATE_CONFIG": acc_path if acc_path.is_file() else acc,
    "RECIPE_VLLM_PORT": recipe.get("vllm_server_port", 8000),
    "USE_VLLM": str(bool(recipe.get("use_vllm"))).lower(),
}
for name, value in out.items():
    print(f"{name}={shlex.quote(str(value))}")
print("VLLM_FLAGS=(" + " ".join(shlex.quote(f) for f in flags) + ")")
print("VLLM_EXTRA=(" + " ".join(shlex.quote(str(a)) for a in launch.get("vllm_extra_args") or []) + ")")
EOF
)"
VLLM_PORT=${VLLM_PORT:-$RECIPE_VLLM_PORT}

if [[ $MODE == slurm && ${#TRAIN_NODES_LIST[@]} -ne $TRAIN_NODES ]]; then
  echo "note: the recipe plans $TRAIN_NODES training nodes, the allocation has ${#TRAIN_NODES_LIST[@]}; using" \
       "${#TRAIN_NODES_LIST[@]} (keep per_device x processes x gradient_accumulation_steps at the batch you want)" >&2
  TRAIN_NODES=${#TRAIN_NODES_LIST[@]}
fi
if [[ $LAUNCHER == torchrun && $ACCELERATE_NAME != ddp ]]; then
  echo "LAUNCHER=torchrun runs plain DDP; the recipe asks for '$ACCELERATE_NAME': use LAUNCHER=accelerate" >&2
  exit 2
fi

# --- commands ----------------------------------------------------------------------------------------------
vllm_command() {  # $1 = extra flags for this layout
  # shellcheck disable=SC2206
  local extra=($1)
  echo trl vllm-serve --model "$MODEL" --host 0.0.0.0 --port "$VLLM_PORT" "${VLLM_FLAGS[@]}" "${extra[@]}" \
    "${VLLM_EXTRA[@]}"
}

wait_for_vllm() {
  [[ ${DRY_RUN:-0} == 1 ]] && { echo "+ wait for http://$VLLM_HOST:$VLLM_PORT/health" >&2; return; }
  local url="http://$VLLM_HOST:$VLLM_PORT/health" waited=0
  until curl -sf "$url" >/dev/null 2>&1; do
    sleep 10; waited=$((waited + 10))
    if (( waited % 300 == 0 )); then echo "still waiting for $url (${waited}s)" >&2; fi
    if (( waited > ${VLLM_WAIT_S:-3600} )); then echo "vLLM server not up after ${waited}s" >&2; exit 1; fi
  done
}

train_command() {  # $1 = number of machines, $2 = machine rank, $3 = processes per machine
  local machines=$1 rank=$2 per_node=$3
  if [[ $LAUNCHER == torchrun ]]; then
    echo torchrun --nnodes "$machines" --nproc_per_node "$per_node" --node_rank "$rank" \
      --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
      -m triage train --config "$RUN_DIR/recipe.yaml"
  else
    echo accelerate launch --config_file "$ACCELERATE_CONFIG" \
      --num_machines "$machines" --num_processes $((machines * per_node)) --machine_rank "$rank" \
      --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
      $([[ $machines -gt 1 ]] && echo --rdzv_backend c10d) \
      -m triage train --config "$RUN_DIR/recipe.yaml"
  fi
}

case $MODE in
  slurm)
    if [[ $USE_VLLM == true ]]; then
      # shellcheck disable=SC2046
      run_logged "$RUN_DIR/vllm-srun.log" srun --nodes=1 --ntasks=1 --nodelist="$VLLM_HOST" \
        --output="$RUN_DIR/vllm-%j.log" $(vllm_command "")
      VLLM_PID=${!:-}
      wait_for_vllm
    fi
    TRAIN_LIST=$(IFS=,; echo "${TRAIN_NODES_LIST[*]}")
    # One task per training node; SLURM_PROCID inside the step is the machine rank (0 = MASTER_ADDR).
    CMD=$(train_command "$TRAIN_NODES" '$SLURM_PROCID' "$GPUS_PER_NODE")
    run srun --nodes="$TRAIN_NODES" --ntasks="$TRAIN_NODES" --ntasks-per-node=1 --nodelist="$TRAIN_LIST" \
      --output="$RUN_DIR/train-%j-%t.log" bash -c "$CMD"
    if [[ -n ${VLLM_PID:-} ]]; then kill "$VLLM_PID" 2>/dev/null || true; fi
    ;;
  manual)
    if [[ $ROLE == vllm ]]; then
      # shellcheck disable=SC2046
      run $(vllm_command "")
    else
      [[ $USE_VLLM == true ]] && wait_for_vllm
      # shellcheck disable=SC2046
      run $(train_command "$TRAIN_NODES" "$NODE_RANK" "$GPUS_PER_NODE")
    fi
    ;;
  single)
    VLLM_GPUS=${VLLM_GPUS:-4}
    TOTAL=${NUM_GPUS:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
    (( TOTAL > 0 )) || { echo "single mode: no GPU found (set NUM_GPUS)" >&2; exit 2; }
    TRAIN_GPUS=$((TOTAL - VLLM_GPUS))
    (( TRAIN_GPUS >= 1 )) || { echo "single mode: $TOTAL GPUs, $VLLM_GPUS for vLLM leaves none" >&2; exit 2; }
    VLLM_DEVICES=$(seq -s, 0 $((VLLM_GPUS - 1)))
    TRAIN_DEVICES=$(seq -s, "$VLLM_GPUS" $((TOTAL - 1)))
    if [[ $USE_VLLM == true ]]; then
      # shellcheck disable=SC2046
      run_logged "$RUN_DIR/vllm.log" env CUDA_VISIBLE_DEVICES="$VLLM_DEVICES" \
        $(vllm_command "--data_parallel_size $VLLM_GPUS --tensor_parallel_size 1")
      VLLM_PID=${!:-}
      wait_for_vllm
    fi
    # shellcheck disable=SC2046
    run env CUDA_VISIBLE_DEVICES="$TRAIN_DEVICES" $(train_command 1 0 "$TRAIN_GPUS")
    if [[ -n ${VLLM_PID:-} ]]; then kill "$VLLM_PID" 2>/dev/null || true; fi
    ;;
esac
