#!/usr/bin/env bash
# Run benchmark scripts on the GPU box, each under its own time limit, logs under $OUT.
#   bash experiments/bench/run_gpu.sh "bench_quantize.py --quick" "bench_gemm.py --quick" ...
# Each script writes its JSON/logs to $OUT (a scratch folder); everything comes back as one tarball.
# Time limits: BENCH_LIMIT seconds per script (default 150), or BENCH_LIMITS="90,90,300" one per script in order
# (a missing entry falls back to BENCH_LIMIT). A spec starting with "pytest" runs `python3 -m pytest ...` from
# the repository root instead (after the install), e.g. "pytest -q -m gpu tests/kernels/gemm".
# Installs carried wheels (.whl/: pip download the trl/datasets/math-verify wheels for the GPU box's Python) and the package itself (no network).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
REAL_OUT=${OUT:-}; export OUT=/tmp/bench-out; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
IFS=, read -r -a LIMITS <<<"${BENCH_LIMITS:-}"
i=0
for spec in "$@"; do
  LIMIT=${LIMITS[$i]:-${BENCH_LIMIT:-150}}
  i=$((i + 1))
  name=$i-$(echo "$spec" | awk '{print $1}' | sed 's/\.py$//')
  echo "=== $spec (limit ${LIMIT}s)"
  if [[ $spec == pytest* ]]; then
    # shellcheck disable=SC2086
    timeout "$LIMIT" python3 -m $spec -p no:cacheprovider >"$OUT/$name.log" 2>&1
  else
    # shellcheck disable=SC2086
    timeout "$LIMIT" python3 experiments/bench/$spec >"$OUT/$name.log" 2>&1
  fi
  rc=$?
  tail -n "${TAIL:-40}" "$OUT/$name.log"
  echo "=== $name rc=$rc"
done
[ -n "$REAL_OUT" ] && tar czf "$REAL_OUT/bench-results.tgz" -C "$OUT" . && echo "results: bench-results.tgz"
exit 0
