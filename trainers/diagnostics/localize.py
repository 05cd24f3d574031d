"""Layer localiser: where along the depth two execution paths start to disagree, and how fast it grows.

For decoder layer l with outputs h_l (path a) and g_l (path b) over the valid token positions,

    d_l = ‖h_l − g_l‖₂ / ‖g_l‖₂                       (relative RMS divergence, all positions pooled)

The first divergent layer is the smallest l with d_l > threshold. The growth with depth is the per-layer
factor r of a least-squares fit log d_l ≈ c + l·log r over the layers with d_l > 0 (r > 1: the error
compounds; None with fewer than two such layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["LayerReport", "growth_per_layer", "layer_divergence", "localize"]


@dataclass
class LayerReport:
    divergence: list[float]
    threshold: float
    first_layer: int | None
    growth_per_layer: float | None

    def to_dict(self) -> dict:
        return {
            "divergence": self.divergence,
            "threshold": self.threshold,
            "first_layer": self.first_layer,
            "growth_per_layer": self.growth_per_layer,
        }


def layer_divergence(a: list[torch.Tensor], b: list[torch.Tensor], mask: torch.Tensor) -> list[float]:
    """``d_l`` for every layer; ``a``/``b`` are per-layer (B, L, H) outputs, ``mask`` (B, L) the valid positions."""
    if len(a) != len(b):
        raise ValueError(f"the two paths recorded {len(a)} and {len(b)} decoder layers")
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or x.shape[:2] != mask.shape:
            raise ValueError(
                f"layer {i}: output shapes {tuple(x.shape)} vs {tuple(y.shape)} do not fit mask {tuple(mask.shape)}"
            )
        m = mask.to(x.device).bool()
        diff = (x[m].double() - y[m].double()).norm()
        ref = y[m].double().norm()
        if not torch.isfinite(diff):
            raise ValueError(f"layer {i}: non-finite output in one of the paths")
        out.append(float(diff / ref) if ref > 0 else float(diff))
    return out


def growth_per_layer(divergence: list[float]) -> float | None:
    points = [(i, math.log(d)) for i, d in enumerate(divergence) if d > 0]
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(i for i, _ in points) / n
    my = sum(v for _, v in points) / n
    sxx = sum((i - mx) ** 2 for i, _ in points)
    sxy = sum((i - mx) * (v - my) for i, v in points)
    return math.exp(sxy / sxx)


def localize(
    a: list[torch.Tensor], b: list[torch.Tensor], mask: torch.Tensor, threshold: float = 1e-2
) -> LayerReport:
    """Per-layer divergence, the first layer above ``threshold`` (None if none) and the growth factor."""
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    div = layer_divergence(a, b, mask)
    first = next((i for i, d in enumerate(div) if d > threshold), None)
    return LayerReport(div, float(threshold), first, growth_per_layer(div))
