"""Run by ``accelerate launch --multi_gpu --num_processes 2`` (CPU, gloo) from test_trainer_ddp.py.

2 TRIAGE steps built the way ``triage train --config`` builds them (recipe → ``build_trainer``), with the
built-in HF sampler on a bf16 copy. argv: model_dir output_dir. Rank 0 writes ``result.json`` (log history,
τ state); every rank checks that all ranks hold the same τ.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trainer_testkit import TINY_RECIPE  # noqa: E402  (this script's folder is on sys.path)

from triage.experiments.train import build_trainer  # noqa: E402

RECIPE = {**TINY_RECIPE, "dataset": {**TINY_RECIPE["dataset"], "n": 16}, "per_device_train_batch_size": 2}


def main(model_dir: str, output_dir: str) -> None:
    import faulthandler

    import yaml

    faulthandler.dump_traceback_later(120, exit=True)  # a hang prints every thread's stack for the test

    from triage.experiments.recipes import load_recipe

    path = os.path.join(output_dir, f"recipe-rank{os.environ.get('RANK', '0')}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({**RECIPE, "model_name_or_path": model_dir}, f)
    recipe = load_recipe(path)  # base.yaml <- this file, validated, as `triage train --config` does
    trainer = build_trainer(recipe, output_dir)
    trainer.train()
    if trainer.accelerator.is_main_process:
        result = {
            "world_size": trainer.accelerator.num_processes,
            "history": trainer.state.log_history,
            "tau": trainer.adaptive_tau.state_dict(),
        }
        with open(os.path.join(output_dir, "result.json"), "w") as f:
            json.dump(result, f)
    # every rank must hold the same τ (it is updated from the gathered δ)
    import torch

    taus = trainer.accelerator.gather(torch.tensor([trainer.adaptive_tau.value], dtype=torch.float64))
    assert torch.all(taus == taus[0]), taus.tolist()
    # as `triage train` does: release the DDP model, then destroy the process group. Without destroying it,
    # gloo's threads can abort the process at exit ("terminate called without an active exception"); freeing
    # the DDP reducer after destroying it can hang.
    accelerator = trainer.accelerator
    del trainer
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
