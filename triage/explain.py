"""``triage explain``: print the class / weight table a ``TriageConfig`` implies.

    triage explain                                 # the defaults
    triage explain --correction tis --is_cap 3
    triage explain --config recipe.yaml --tau auto # a recipe's TriageConfig fields, then flag overrides

The table's sample columns are the weights ``token_weights`` actually returns for one token at that δ
(computed, not described), so what is printed is what training will do.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
from typing import Any

import torch

from triage.classes import POLICY_CLASSES, TokenClass
from triage.config import TriageConfig
from triage.weights import token_weights

CONDITIONS = {
    TokenClass.CONSISTENT: "|δ| ≤ τ",
    TokenClass.AMPLIFY_DOWN: "δ < −τ, A < 0",
    TokenClass.CORRECT_UP: "δ < −τ, A > 0",
    TokenClass.AMPLIFY_UP: "δ > τ, A > 0",
    TokenClass.CORRECT_DOWN: "δ > τ, A < 0",
}
RISK = {
    TokenClass.CONSISTENT: "none",
    TokenClass.AMPLIFY_DOWN: "high",
    TokenClass.CORRECT_UP: "low",
    TokenClass.AMPLIFY_UP: "medium",
    TokenClass.CORRECT_DOWN: "low",
}
BASELINE_RULES = {
    "none": "w = 1 on every valid token (vanilla GRPO)",
    "tis": "w = min(exp δ, is_cap)  (token truncated IS)",
    "icepop": "w = exp δ if icepop_low ≤ exp δ ≤ icepop_high else 0  (token two-sided mask)",
    "seq-mis": "w = ρ if seq_mis_low ≤ ρ ≤ seq_mis_high else 0, ρ = Π exp δ (product) or exp(mean δ) (geometric)",
    "opsm": "w = 0 for a response with A < 0 and mean δ < −opsm_threshold, else 1",
    "veto": "w = 0 for a response with any exp δ < veto_floor, else 1",
}


def policy_formula(policy: str, config: TriageConfig) -> str:
    return {
        "keep": "1",
        "is": f"min(exp δ, {config.is_cap:g})",
        "soft": f"exp(−{config.soft_rate:g}·(|δ| − τ))",
        "mask": "0",
    }[policy]


def sample_deltas(tau: float) -> list[float]:
    return [-3.5, -1.0, -2 * tau, -tau / 2, tau / 2, 2 * tau, 1.0]


def weight_at(delta: float, advantage: float, config: TriageConfig, tau: float) -> float:
    """The weight ``token_weights`` gives one lone token (guard off: it is a sequence-level effect)."""
    cfg = TriageConfig(**{**config.to_dict(), "guard_kappa": None})
    d = torch.tensor([[delta]])
    return float(token_weights(d, torch.tensor([advantage]), torch.ones(1, 1), cfg, tau=tau)[0, 0])


def render(config: TriageConfig, tau: float | None = None) -> str:
    tau = config.fixed_tau() if tau is None else tau
    lines = [f"correction = {config.correction}"]
    if config.correction != "triage":
        lines.append(BASELINE_RULES[config.correction])
        deltas = [-10.0, -3.5, -1.0, -0.1, 0.0, 0.1, 1.0, 2.0]
        lines.append("")
        lines.append("weight of a one-token response at δ (A = +1 / A = −1):")
        for d in deltas:
            lines.append(
                f"  δ = {d:+7.3f}   {weight_at(d, 1.0, config, tau):8.4f} / {weight_at(d, -1.0, config, tau):8.4f}"
            )
        return "\n".join(lines)

    tau_text = (
        f"auto (starts at {tau:g}, then {config.tau_multiplier:g} × EMA median |δ|, ≥ {config.tau_floor:g})"
    )
    lines.append(f"τ = {tau_text if config.adaptive else f'{tau:g}'} nats")
    deltas = sample_deltas(tau)
    header = f"{'class':<13} {'condition':<15} {'risk':<7} {'policy':<6} {'weight':<26}"
    header += "".join(f"δ={d:+.3g}".rjust(10) for d in deltas)
    lines += ["", header, "-" * len(header)]
    for cls in POLICY_CLASSES:
        policy = getattr(config, cls.label)
        formula = policy_formula(policy, config)
        if cls == TokenClass.AMPLIFY_DOWN and config.tail_floor is not None and policy != "mask":
            formula += f"; 0 if δ < −{config.tail_floor:g}"
        cells = []
        for d in deltas:
            in_band = abs(d) <= tau
            sign = {
                TokenClass.AMPLIFY_DOWN: (-1, -1),
                TokenClass.CORRECT_UP: (-1, 1),
                TokenClass.AMPLIFY_UP: (1, 1),
                TokenClass.CORRECT_DOWN: (1, -1),
            }.get(cls)
            if cls == TokenClass.CONSISTENT:
                cells.append(f"{weight_at(d, 1.0, config, tau):.4f}" if in_band else "·")
            elif not in_band and math.copysign(1, d) == sign[0]:
                cells.append(f"{weight_at(d, float(sign[1]), config, tau):.4f}")
            else:
                cells.append("·")
        lines.append(
            f"{cls.label:<13} {CONDITIONS[cls]:<15} {RISK[cls]:<7} {policy:<6} {formula:<26}"
            + "".join(c.rjust(10) for c in cells)
        )
    lines.append(f"{'inert':<13} {'A = 0':<15} {'none':<7} {'-':<6} {'1 (no gradient)':<26}")
    guard = (
        "off"
        if config.guard_kappa is None
        else f"responses with A < 0 and Σ_amplify-down |δ| / tokens > {config.guard_kappa:g} are scaled by κ/m"
    )
    lines += ["", f"sequence guard: {guard}", "masked and down-weighted tokens stay in the loss normaliser"]
    return "\n".join(lines)


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (a recipe is fine: non-TriageConfig keys are ignored)")
    for f in fields(TriageConfig):
        parser.add_argument(
            f"--{f.name}", type=_parse_value, default=argparse.SUPPRESS, help=f"(default {f.default!r})"
        )


def load_config(args: argparse.Namespace) -> TriageConfig:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        import yaml

        with open(args.config) as handle:
            loaded = yaml.safe_load(handle) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(
                f"{args.config}: expected a mapping of config fields, got {type(loaded).__name__}"
            )
        if "preset" in loaded or "arm" in loaded:  # layered: its TRIAGE fields live in base/preset/arm files
            raise ValueError(
                f"{args.config} is a layered recipe (preset/arm), which this core command does not resolve; "
                f"flatten it first: python -m triage.experiments.recipes {args.config} -o flat.yaml, then "
                "triage explain --config flat.yaml"
            )
        values.update(loaded.get("triage", loaded) if isinstance(loaded.get("triage"), dict) else loaded)
    values.update({k: v for k, v in vars(args).items() if k in TriageConfig.field_names()})
    for f in fields(TriageConfig):  # "none" switches off an optional knob (tail_floor, guard_kappa)
        if "None" in str(f.type) and str(values.get(f.name, "")).lower() in ("none", "null", "off"):
            values[f.name] = None
    return TriageConfig.from_dict(values)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
    except ValueError as err:
        print(f"triage explain: {err}")
        return 2
    print(render(config))
    return 0
