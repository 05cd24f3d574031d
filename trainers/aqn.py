"""Adaptive quantization noise (AQN; QeRL, Huang et al. 2025, arXiv:2510.11696, §3.3).

Channel-wise Gaussian noise ``Z ~ N(0, σ²I)`` folded into the RMSNorm scales that feed the quantized
projections, ``w_noise = w + Z`` (Eq. 10), so that ``RMSNorm_noise(x)·Ŵᵀ = RMSNorm(x)·(diag(1 + Z/w)·Ŵ)ᵀ``
perturbs every row of the frozen weight multiplicatively without touching the NVFP4 bytes. σ follows the
exponential schedule of Eq. 8 over K evenly spaced stages k = 0…K−1 of training: the first stage carries the
quantization noise only (σ = 0), as in the paper, and the K−1 noisy stages follow
``σ(k) = σ_start·(σ_end/σ_start)^((k−1)/(K−2))`` (``k/(K−1)`` with ``quant_noise_first_stage=False``). Off by
default (add :class:`AQNCallback`).
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers import TrainerCallback

__all__ = ["AQNCallback", "AQNConfig", "AdaptiveQuantizationNoise", "aqn_sigma"]


@dataclass(frozen=True)
class AQNConfig:
    """QeRL's adaptive quantization noise (module docstring). Defaults: §3.3 of the paper (σ_start = 1e-2,
    10 stages); σ_end = 1e-4 keeps the 100× range of their §4.1 (5e-2 → 5e-4).

    Attributes:
        sigma_start / sigma_end: noise std of the first / last noisy stage (> 0).
        num_stages: K, stages evenly dividing the training steps.
        quant_noise_first_stage: the first stage adds no noise (the quantization noise alone), as in QeRL.
        targets: fnmatch patterns of the RMSNorm modules whose scale carries the noise: those in front of
            q/k/v and gate/up (QeRL Fig. 6).
        seed: the noise of step s is drawn from ``seed + s`` (same on every process).
    """

    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    num_stages: int = 10
    quant_noise_first_stage: bool = True
    targets: tuple[str, ...] = ("*input_layernorm", "*post_attention_layernorm")
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.targets, list):  # from YAML / JSON
            object.__setattr__(self, "targets", tuple(self.targets))
        for name in ("sigma_start", "sigma_end"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"AQNConfig.{name} must be finite and > 0 (exponential schedule), got {v!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"AQNConfig.num_stages must be an int >= 1, got {self.num_stages!r}")
        if self.quant_noise_first_stage and self.num_stages < 2:
            raise ValueError(
                "AQNConfig: quant_noise_first_stage=True needs num_stages >= 2 (else no noisy stage)"
            )
        if isinstance(self.targets, str) or not self.targets:
            raise ValueError(f"AQNConfig.targets must be a non-empty tuple of patterns, got {self.targets!r}")


def aqn_sigma(step: int, total_steps: int, config: AQNConfig) -> float:
    """σ at optimizer step ``step`` of ``total_steps``: stage k = ⌊step·K/total⌋ (clamped to K−1), then
    QeRL Eq. 8 over the noisy stages (stage 0 is noise-free when ``quant_noise_first_stage``)."""
    if total_steps < 1:
        raise ValueError(f"aqn_sigma: total_steps must be >= 1, got {total_steps}")
    if step < 0:
        raise ValueError(f"aqn_sigma: step must be >= 0, got {step}")
    k_total = config.num_stages
    stage = min(k_total - 1, step * k_total // total_steps)
    if config.quant_noise_first_stage:
        if stage == 0:
            return 0.0
        stage, k_total = stage - 1, k_total - 1
    if k_total == 1:
        return float(config.sigma_start)
    ratio = config.sigma_end / config.sigma_start
    return float(config.sigma_start * ratio ** (stage / (k_total - 1)))


class AdaptiveQuantizationNoise:
    """Folds ``σ·ε`` (ε ~ N(0, I) per channel, fresh each :meth:`apply`) into the target RMSNorm weights.

    The clean weights are kept (``aqn_clean_weight``, a non-persistent buffer on each norm) so that
    :meth:`remove` restores them bit for bit and the exports write them. The norm weights must be frozen
    (an optimizer update on a noisy weight would be lost at the next resample).

    Floor: the noise is folded in the norm weights' own dtype, so a perturbation below half an ulp of ``w``
    rounds away (bf16, ``|w| ≈ 1``: half an ulp is 2⁻⁸ ≈ 3.9e-3, and σ ≲ 1e-3 leaves almost nothing).
    :meth:`apply` measures the realised std of ``w_noise − w`` after the cast and warns (once per σ) when
    it is below half the requested σ.
    """

    BUFFER = "aqn_clean_weight"

    def __init__(self, config: AQNConfig | None = None):
        self.config = config or AQNConfig()
        self.norms: list[tuple[str, nn.Module]] = []
        self.sigma = 0.0
        self._warned: set[float] = set()

    def attach(self, model: nn.Module) -> AdaptiveQuantizationNoise:
        self.norms = [
            (n, m)
            for n, m in model.named_modules()
            if any(fnmatch.fnmatchcase(n, p) for p in self.config.targets)
        ]
        if not self.norms:
            raise ValueError(f"AQN: no module of the model matches {self.config.targets}")
        for name, m in self.norms:
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                raise ValueError(
                    f"AQN: {name!r} has no 1-D weight (not an RMSNorm scale); fix AQNConfig.targets"
                )
            if w.requires_grad:
                raise ValueError(
                    f"AQN: {name!r}.weight is trainable; the noise is folded into it, so it must be frozen"
                )
            if getattr(m, self.BUFFER, None) is None:
                m.register_buffer(self.BUFFER, w.detach().clone(), persistent=False)
        return self

    @torch.no_grad()
    def apply(self, step: int, total_steps: int) -> float:
        """Set every target weight to ``clean + σ(step)·ε``; returns σ."""
        if not self.norms:
            raise RuntimeError("AQN.apply before attach(model)")
        self.sigma = aqn_sigma(step, total_steps, self.config)
        gen = torch.Generator().manual_seed(self.config.seed + int(step))
        realised = []
        for _, m in self.norms:
            clean = getattr(m, self.BUFFER)
            if self.sigma == 0.0:
                m.weight.copy_(clean)
                continue
            eps = torch.randn(clean.shape, generator=gen, dtype=torch.float32).to(clean.device)
            m.weight.copy_((clean.float() + self.sigma * eps).to(clean.dtype))
            realised.append((m.weight.float() - clean.float()).flatten())
        if realised and self.sigma not in self._warned:
            std = torch.cat(realised).std(correction=0).item()
            if std < 0.5 * self.sigma:
                self._warned.add(self.sigma)
                warnings.warn(
                    f"AQN: realised noise std {std:.3g} for the requested sigma {self.sigma:.3g}: the noise is "
                    f"below the resolution of the norm weights' dtype ({self.norms[0][1].weight.dtype}; half an "
                    "ulp of |w|) and rounds away; use a larger sigma or keep the norm weights in float32",
                    stacklevel=2,
                )
        return self.sigma

    @torch.no_grad()
    def remove(self) -> None:
        """Restore the clean weights and drop the saved copies."""
        for _, m in self.norms:
            clean = getattr(m, self.BUFFER, None)
            if clean is not None:
                m.weight.copy_(clean)
                delattr(m, self.BUFFER)
        self.norms = []
        self.sigma = 0.0


class AQNCallback(TrainerCallback):
    """Trainer callback running :class:`AdaptiveQuantizationNoise` over ``max_steps``.

    The noise is resampled at the optimizer steps that start a generation (GRPO: every
    ``steps_per_generation × num_iterations`` micro-batches), so the sampler's rollout and the learner's
    forward/backward on it see the same perturbed policy — the noise never enters δ. (Resampling per forward,
    as QeRL's Eq. 7 reads, would add it to the measured engine mismatch.) The windows are those of the whole
    run (micro-step ``global_step × gradient_accumulation_steps``): a run resumed inside a window trains on
    the window's saved rollouts (``TriageGRPOTrainer`` restores them), so it folds the noise of the window's
    first step, that of the uninterrupted run. ``history`` records (step, σ) at every fold.
    """

    def __init__(self, config: AQNConfig | None = None):
        self.noise = AdaptiveQuantizationNoise(config)
        self.history: list[tuple[int, float]] = []
        self._window: int | None = None  # the first step of the window whose noise is folded in

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("AQNCallback needs the trainer's model")
        self.noise.attach(model)
        self._window = None

    def on_step_begin(self, args, state, control, **kwargs):
        every = int(getattr(args, "steps_per_generation", None) or 1) * int(
            getattr(args, "num_iterations", 1) or 1
        )
        window = state.global_step  # the last optimizer step <= this one that starts a generation
        while (window * args.gradient_accumulation_steps) % every:
            window -= 1
        if window != self._window:
            sigma = self.noise.apply(window, max(state.max_steps, 1))
            self._window = window
            self.history.append((state.global_step, sigma))

    def on_train_end(self, args, state, control, **kwargs):
        self.noise.remove()
