"""Run by ``accelerate launch --multi_gpu --num_processes 2`` (CPU, gloo) from test_trainer_ddp.py: 2 TRIAGE steps.

argv: model_dir output_dir. Rank 0 writes ``result.json``: the log history and, per step, the global number of
completion tokens counted independently from TRL's gathered completion lengths.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_testkit import make_trainer  # noqa: E402


def main(model_dir: str, output_dir: str) -> None:
    trainer = make_trainer(model_dir, output_dir, tau="auto", per_device_train_batch_size=2, max_steps=2)
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
