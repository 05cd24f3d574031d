"""One W4A16 decode-kernel launch for Nsight Compute to read its counters (stall reasons, issue rate, bytes).

    ncu --clock-control none -k regex:_decode_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section LaunchStats python experiments/bench/ncu_decode.py down 16

Arguments: the Qwen3-4B layer (``qkv``, ``o``, ``gate_up``: the sibling groups' one launch; ``down``) and
M. Four launches of the default tiles on random weights (the sampler copy's recipe: per-row outer scales,
compressed-tensors profile): the fourth is the one to profile (the first compiles). ncu flushes the caches
before each profiled pass by default, so the weights are read from memory, as in a model.
"""

import sys

import torch

from triage.kernels.nvfp4 import QuantRecipe, quantize
from triage.kernels.nvfp4 import gemm_decode as gd

#: Qwen3-4B: the members' rows and K of each launch
LAYERS = {"qkv": ((4096, 1024, 1024), 2560), "o": ((2560,), 4096), "gate_up": ((9728, 9728), 2560),
          "down": ((2560,), 9728)}  # fmt: skip


def main(layer: str, m: int) -> None:
    rows, k = LAYERS[layer]
    recipe = QuantRecipe(scale="row", profile="compressed-tensors")
    ws = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, recipe) for n in rows]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n in rows]
    for _ in range(4):
        if len(ws) == 1:
            gd.launch_decode(
                x, ws[0].data, ws[0].scale, k, outs[0], None, ws[0].global_scale.reshape(-1), None
            )
        else:
            members = [(w.data, w.scale, o, w.global_scale.reshape(-1), None) for w, o in zip(ws, outs)]
            gd.launch_decode_group(x, members, k, None)
    torch.cuda.synchronize()
    launch = gd.default_launch(m, rows if len(rows) > 1 else rows[0], k, k // 16, x.dtype, x.dtype, x.device)
    print(f"{layer} M={m}: grid {launch.grid}, split {launch.split}, tiles {launch.kwargs}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
