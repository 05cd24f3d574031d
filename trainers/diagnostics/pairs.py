"""Execution-path pairs: δ per token and divergence per layer between a learner and a sampler path.

``compare_paths`` prepares one model copy per path from the same master, scores the same
:class:`~.paths.TokenBatch` with both and returns a :class:`PairReport`:

* ``delta`` = log π_learner(y_t) − log π_sampler(y_t) (B, C), 0 at padding (``triage.token_gap``);
* ``layers``: the :class:`~.localize.LayerReport` of the decoder-layer outputs;
* ``stats(tau)``: mean |δ|, δ quantiles and TRIAGE class shares (``triage.mismatch_metrics``) under
  balanced synthetic advantages A = +1 on even rows, −1 on odd rows (so the shares show how δ would split
  into the four tails of a real batch with as many positive as negative responses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from triage import TriageConfig, mismatch_metrics, token_gap

from .localize import LayerReport, localize
from .paths import ExecutionPath, PathResult, TokenBatch, prepare_model, run_path
from .strict import check_strict_pair

__all__ = ["CLASS_KEYS", "PairReport", "PathRunner", "compare_paths", "gap_stats"]

CLASS_KEYS = ("consistent", "amplify_down", "correct_up", "amplify_up", "correct_down")


def synthetic_advantages(rows: int) -> torch.Tensor:
    return torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(rows)])


def gap_stats(delta: torch.Tensor, mask: torch.Tensor, tau: float) -> dict:
    """Mean |δ|, δ quantiles and class shares (balanced synthetic advantages, tolerance ``tau``)."""
    delta, mask = delta.detach().cpu(), mask.cpu()
    adv = synthetic_advantages(delta.shape[0])
    metrics = mismatch_metrics(delta, adv, mask, torch.ones_like(delta), TriageConfig(tau=tau), tau=tau)
    return {
        "tokens": int(mask.sum()),
        "mean_abs_delta": metrics["triage/mean_abs_delta"],
        "mean_delta": metrics["triage/mean_delta"],
        "max_abs_delta": float(delta[mask.bool()].abs().max()) if mask.any() else 0.0,
        "quantiles": {
            k.removeprefix("triage/delta_"): v for k, v in metrics.items() if k.startswith("triage/delta_p")
        },
        "class_shares": {k: metrics[f"triage/{k}/share"] for k in CLASS_KEYS},
        "tau": tau,
    }


@dataclass
class PairReport:
    learner: ExecutionPath
    sampler: ExecutionPath
    delta: torch.Tensor
    mask: torch.Tensor
    layers: LayerReport
    learner_seconds: float
    sampler_seconds: float

    @property
    def mean_abs_delta(self) -> float:
        return float(self.delta[self.mask].abs().mean()) if self.mask.any() else 0.0

    def stats(self, tau: float = 0.01) -> dict:
        return gap_stats(self.delta, self.mask, tau)


class PathRunner:
    """Runs paths on one master model and batch, caching each path's result (rows share paths)."""

    def __init__(self, master: nn.Module, batch: TokenBatch, calibration: dict[str, float] | None = None):
        self.master, self.batch, self.calibration = master, batch, calibration
        self._results: dict[ExecutionPath, PathResult] = {}

    def run(self, path: ExecutionPath) -> PathResult:
        if path not in self._results:
            if (
                path.precision.act_scale == "static"
                and path.precision.mode == "w4a4"
                and self.calibration is None
            ):
                raise ValueError(
                    f"{path.label()}: act_scale='static' needs calibration= (calibrate_activation_amax)"
                )
            model = prepare_model(self.master, path, self.calibration)
            self._results[path] = run_path(model, path, self.batch)
            del model
        return self._results[path]

    def compare(self, learner: ExecutionPath, sampler: ExecutionPath, threshold: float = 1e-2) -> PairReport:
        if learner.kind != "learner" or sampler.kind != "sampler":
            raise ValueError(f"compare(learner, sampler) got kinds {learner.kind!r}, {sampler.kind!r}")
        if learner.strict or sampler.strict:
            check_strict_pair(learner.precision, sampler.precision, sampler.kv_cache)
        a, b = self.run(learner), self.run(sampler)
        mask = self.batch.completion_mask.to(a.logps.device)
        delta = token_gap(a.logps, b.logps, mask)
        layers = localize(a.layers, b.layers, self.batch.input_mask, threshold)
        return PairReport(learner, sampler, delta, mask, layers, a.seconds, b.seconds)


def compare_paths(
    master: nn.Module,
    learner: ExecutionPath,
    sampler: ExecutionPath,
    batch: TokenBatch,
    calibration: dict[str, float] | None = None,
    threshold: float = 1e-2,
) -> PairReport:
    """Score ``batch`` with both paths (each on its own copy of ``master``) and compare them."""
    return PathRunner(master, batch, calibration).compare(learner, sampler, threshold)
