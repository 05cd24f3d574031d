"""``triage explain``: print the class / weight table a ``TriageConfig`` implies.

    triage explain                                 # the defaults
    triage explain --correction tis --is_cap 3
    triage explain --config recipe.yaml --tau auto # a recipe's TriageConfig fields, then flag overrides

The table's sample columns are the weights ``token_weights`` actually returns for one token at that δ
(computed, not described), so what is printed is what training will do. With ``--tau_space prob`` a token's
class also depends on its sampler probability p_s: the columns are for p_s = :data:`P_SAMPLER` (0.5), and a
second table gives the band's edges in δ for a few p_s.
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
CONDITIONS_PROB = {
    TokenClass.CONSISTENT: "|Δp| ≤ τ",
    TokenClass.AMPLIFY_DOWN: "Δp < −τ, A < 0",
    TokenClass.CORRECT_UP: "Δp < −τ, A > 0",
    TokenClass.AMPLIFY_UP: "Δp > τ, A > 0",
    TokenClass.CORRECT_DOWN: "Δp > τ, A < 0",
}
#: The sampler probability of the sample columns in probability space, and those of the band-edge table.
P_SAMPLER = 0.5
EDGE_PROBABILITIES = (0.01, 0.1, 0.3, 0.5, 0.9)
BASELINE_RULES = {
    "none": "w = 1 on every valid token (vanilla GRPO)",
    "tis": "w = min(exp δ, is_cap)  (token truncated IS)",
    "icepop": "w = exp δ if icepop_low ≤ exp δ ≤ icepop_high else 0  (token two-sided mask)",
    "seq-mis": "w = ρ if seq_mis_low ≤ ρ ≤ seq_mis_high else 0, ρ = Π exp δ (product) or exp(mean δ) (geometric)",
    "opsm": "w = 0 for a response with A < 0 and mean δ < −opsm_threshold, else 1",
    "veto": "w = 0 for a response with any exp δ < veto_floor, else 1",
}


def policy_formula(policy: str, config: TriageConfig) -> str:
    edge = "τ" if config.tau_space == "log" else "|δ_τ|"
    return {
        "keep": "1",
        "is": f"min(exp δ, {config.is_cap:g})",
        "soft": f"exp(−{config.soft_rate:g}·(|δ| − {edge}))",
        "mask": "0",
    }[policy]


def sample_deltas(tau: float, tau_space: str = "log") -> list[float]:
    if tau_space == "prob":
        return [-3.5, -1.0, -0.5, -0.1, 0.1, 0.5, 1.0]
    return [-3.5, -1.0, -2 * tau, -tau / 2, tau / 2, 2 * tau, 1.0]


def in_band(delta: float, config: TriageConfig, tau: float) -> bool:
    """Whether a token at ``delta`` (and, in probability space, p_s = :data:`P_SAMPLER`) is consistent."""
    if config.tau_space == "prob":
        return abs(P_SAMPLER * math.expm1(delta)) <= tau
    return abs(delta) <= tau


def weight_at(delta: float, advantage: float, config: TriageConfig, tau: float) -> float:
    """The weight ``token_weights`` gives one lone token (guard off: it is a sequence-level effect), with
    sampler probability :data:`P_SAMPLER`."""
    cfg = TriageConfig(**{**config.to_dict(), "guard_kappa": None})
    d = torch.tensor([[delta]])
    sampler = torch.tensor([[math.log(P_SAMPLER)]])
    weights = token_weights(
        d, torch.tensor([advantage]), torch.ones(1, 1), cfg, tau=tau, sampler_logps=sampler
    )
    return float(weights[0, 0])


def band_edges(tau: float) -> list[str]:
    """Lines of the probability band's edges in δ: below it when δ < log(1 − τ/p_s) (only if p_s > τ),
    above it when δ > log(1 + τ/p_s)."""
    lines = ["band edges in δ (nats) by sampler probability p_s, Δp = p_s·(e^δ − 1):"]
    for p in EDGE_PROBABILITIES:
        below = f"δ < {math.log1p(-tau / p):+.3f}" if p > tau else "never (p_s ≤ τ)"
        lines.append(f"  p_s = {p:<5g} below the band: {below:<16}  above it: δ > {math.log1p(tau / p):+.3f}")
    return lines


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
    if config.tau_space == "prob":
        lines.append(
            f"τ = {tau:g} (probability: the band is |Δp| ≤ τ, Δp = p_learner − p_sampler; class by sign δ)"
        )
        lines.append(f"sample columns: one token with sampler probability p_s = {P_SAMPLER:g}")
    else:
        lines.append(f"τ = {tau_text if config.adaptive else f'{tau:g}'} nats")
    conditions = CONDITIONS_PROB if config.tau_space == "prob" else CONDITIONS
    deltas = sample_deltas(tau, config.tau_space)
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
            inside = in_band(d, config, tau)
            sign = {
                TokenClass.AMPLIFY_DOWN: (-1, -1),
                TokenClass.CORRECT_UP: (-1, 1),
                TokenClass.AMPLIFY_UP: (1, 1),
                TokenClass.CORRECT_DOWN: (1, -1),
            }.get(cls)
            if cls == TokenClass.CONSISTENT:
                cells.append(f"{weight_at(d, 1.0, config, tau):.4f}" if inside else "·")
            elif not inside and math.copysign(1, d) == sign[0]:
                cells.append(f"{weight_at(d, float(sign[1]), config, tau):.4f}")
            else:
                cells.append("·")
        lines.append(
            f"{cls.label:<13} {conditions[cls]:<15} {RISK[cls]:<7} {policy:<6} {formula:<26}"
            + "".join(c.rjust(10) for c in cells)
        )
    lines.append(f"{'inert':<13} {'A = 0':<15} {'none':<7} {'-':<6} {'1 (no gradient)':<26}")
    guard = (
        "off"
        if config.guard_kappa is None
        else f"responses with A < 0 and Σ_amplify-down |δ| / tokens > {config.guard_kappa:g} are scaled by κ/m"
    )
    lines += ["", f"sequence guard: {guard}", "masked and down-weighted tokens stay in the loss normaliser"]
    if config.tau_space == "prob":
        lines += ["", *band_edges(tau)]
        if any(getattr(config, cls.label) == "soft" for cls in POLICY_CLASSES):
            lines.append("soft: |δ_τ| is the token's own band edge above (τ itself in log space)")
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
