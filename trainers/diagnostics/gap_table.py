"""The gap table: the learner-sampler mismatch axes on one model, one row per (learner path, sampler path).

Every row scores the same sampled tokens with a learner path (full-sequence forward) and a sampler path
(prefill + incremental decode) and reports mean |δ|, δ quantiles, TRIAGE class shares and the per-layer
divergence. The trainer's recipe is ``W4A4, per-token activation scale, TE profile, online, independent
fused scales`` (``BASE``); each axis changes one thing from it, except the precision axis, which
compares the usual NVFP4 RL engine pair (learner: TE online from the master weights, tensor-wide dynamic
activation amax; sampler: an offline ModelOpt checkpoint of the bf16 weights with static activation
scales, i.e. vLLM's setting) at three precisions:

=================  ==========================  =================================  ===================================
axis               setting                     learner                            sampler
=================  ==========================  =================================  ===================================
precision          bf16 / w4a16 / w4a4         bf16 / TE online / + act=tensor    bf16 / ModelOpt ckpt / + act=static
act_scale          tensor / token / static     W4A4 with that activation scale    the same recipe
kv_cache           bf16 / fp8                  BASE                               BASE, KV cache in the model dtype / FP8
conversion         online / offline            BASE                               BASE / weights from the ModelOpt ckpt
fused_scales       independent / shared        BASE                               BASE / one outer scale per q,k,v & gate,up
alignment          default / strict            BASE (and bf16)                    the same, both batch-invariant (strict)
=================  ==========================  =================================  ===================================
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .pairs import CLASS_KEYS, PathRunner
from .paths import ExecutionPath, TokenBatch, prepare_model
from .precision import Precision, calibrate_activation_amax

__all__ = ["BASE", "GapRow", "default_rows", "format_table", "gap_table", "plot_gap_table", "write_gap_table"]

BASE = Precision(mode="w4a4", act_scale="token")


@dataclass(frozen=True)
class GapRow:
    axis: str
    setting: str
    learner: ExecutionPath
    sampler: ExecutionPath


def default_rows(dtype: torch.dtype = torch.bfloat16) -> list[GapRow]:
    """The rows of the module table for paths computing in ``dtype``."""

    def pair(axis, setting, lp: Precision, sp: Precision, **sampler_kw) -> GapRow:
        strict = sampler_kw.pop("strict", False)
        return GapRow(
            axis,
            setting,
            ExecutionPath("learner", lp, dtype, strict=strict),
            ExecutionPath("sampler", sp, dtype, strict=strict, **sampler_kw),
        )

    ckpt = {"weights_from": "checkpoint", "checkpoint_profile": "modelopt"}
    return [
        pair("precision", "bf16", Precision(), Precision()),
        pair("precision", "w4a16", Precision("w4a16"), Precision("w4a16", **ckpt)),
        pair("precision", "w4a4", Precision("w4a4", "tensor"), Precision("w4a4", "static", **ckpt)),
        pair("act_scale", "tensor", replace(BASE, act_scale="tensor"), replace(BASE, act_scale="tensor")),
        pair("act_scale", "token", BASE, BASE),
        pair("act_scale", "static", replace(BASE, act_scale="static"), replace(BASE, act_scale="static")),
        pair("kv_cache", "bf16" if dtype == torch.bfloat16 else "native", BASE, BASE),
        pair("kv_cache", "fp8", BASE, BASE, kv_cache="fp8"),
        pair("conversion", "online", BASE, BASE),
        pair("conversion", "offline", BASE, replace(BASE, **ckpt)),
        pair("fused_scales", "independent", BASE, BASE),
        pair("fused_scales", "shared", BASE, replace(BASE, fused_scales="shared")),
        pair("alignment", "default", BASE, BASE),
        pair("alignment", "strict", BASE, BASE, strict=True),
        pair("alignment", "bf16 default", Precision(), Precision()),
        pair("alignment", "bf16 strict", Precision(), Precision(), strict=True),
    ]


def _needs_calibration(rows: list[GapRow]) -> bool:
    return any(
        p.precision.mode == "w4a4" and p.precision.act_scale == "static"
        for r in rows
        for p in (r.learner, r.sampler)
    )


def gap_table(
    master: nn.Module,
    batch: TokenBatch,
    rows: list[GapRow] | None = None,
    tau: float = 0.01,
    threshold: float = 1e-2,
) -> dict:
    """Run every row on ``master`` and ``batch``; returns the JSON-ready table (see ``write_gap_table``)."""
    rows = default_rows() if rows is None else rows
    dtypes = {p.dtype for r in rows for p in (r.learner, r.sampler)}
    if len(dtypes) != 1:
        raise ValueError(
            f"gap_table: all paths must share one dtype (one calibration), got {sorted(map(str, dtypes))}"
        )
    device = next(master.parameters()).device
    calibration = None
    if _needs_calibration(rows):
        ref = prepare_model(master, ExecutionPath("learner", Precision(), dtypes.pop()))
        b = batch.to(device)
        calibration = calibrate_activation_amax(ref, b.input_ids, b.attention_mask, b.position_ids)
        del ref
    runner = PathRunner(master, batch, calibration)
    start = time.perf_counter()
    out_rows = []
    for row in rows:
        report = runner.compare(row.learner, row.sampler, threshold)
        stats = report.stats(tau)
        out_rows.append(
            {
                "axis": row.axis,
                "setting": row.setting,
                "learner": row.learner.label(),
                "sampler": row.sampler.label(),
                **stats,
                "layers": report.layers.to_dict(),
                "learner_seconds": report.learner_seconds,
                "sampler_seconds": report.sampler_seconds,
                "_delta": report.delta[report.mask].detach().cpu().tolist(),
            }
        )
    return {
        "tokens": int(batch.completion_mask.sum()),
        "sequences": int(batch.input_ids.shape[0]),
        "tau": tau,
        "layer_threshold": threshold,
        "advantages": "synthetic, balanced: A=+1 on even rows, -1 on odd rows",
        "seconds": time.perf_counter() - start,
        "rows": out_rows,
    }


def strict_speed(table: dict) -> dict | None:
    """Strict vs default (same recipe): mean |δ| and the learner/sampler slowdown, per alignment pair."""
    rows = {r["setting"]: r for r in table["rows"] if r["axis"] == "alignment"}
    out = {}
    for prefix in ("", "bf16 "):
        d, s = rows.get(f"{prefix}default"), rows.get(f"{prefix}strict")
        if d is None or s is None:
            continue
        out[(prefix or "base ").strip()] = {
            "learner_seconds_default": d["learner_seconds"],
            "learner_seconds_strict": s["learner_seconds"],
            "learner_slowdown": s["learner_seconds"] / max(d["learner_seconds"], 1e-12),
            "sampler_slowdown": s["sampler_seconds"] / max(d["sampler_seconds"], 1e-12),
            "mean_abs_delta_default": d["mean_abs_delta"],
            "mean_abs_delta_strict": s["mean_abs_delta"],
        }
    return out or None


def format_table(table: dict) -> str:
    """The table as fixed-width text (mean |δ|, quantiles, class shares, first divergent layer, growth)."""
    short = {
        "consistent": "cons",
        "amplify_down": "amp↓",
        "correct_up": "cor↑",
        "amplify_up": "amp↑",
        "correct_down": "cor↓",
    }
    head = (
        f"{'axis':<13}{'setting':<12}{'mean|δ|':>10}{'p0.1':>10}{'p50':>10}{'p99.9':>10}"
        + "".join(f"{short[k]:>7}" for k in CLASS_KEYS)
        + f"{'layer':>7}{'growth':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in table["rows"]:
        q, c, lay = r["quantiles"], r["class_shares"], r["layers"]
        first = "-" if lay["first_layer"] is None else str(lay["first_layer"])
        growth = "-" if lay["growth_per_layer"] is None else f"{lay['growth_per_layer']:.2f}"
        lines.append(
            f"{r['axis']:<13}{r['setting']:<12}{r['mean_abs_delta']:>10.2e}{q['p0.1']:>10.2e}{q['p50']:>10.2e}"
            f"{q['p99.9']:>10.2e}" + "".join(f"{c[k]:>7.3f}" for k in CLASS_KEYS) + f"{first:>7}{growth:>8}"
        )
    lines.append(
        f"{table['tokens']} tokens, {table['sequences']} sequences; classes at tau={table['tau']} with "
        f"{table['advantages']}; 'layer' = first decoder layer with relative divergence > {table['layer_threshold']}"
    )
    return "\n".join(lines)


def plot_gap_table(table: dict, out_dir: Path) -> list[Path]:
    """``delta_hist.png`` (δ histogram per row) and ``layer_divergence.png`` (d_l per row, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["rows"]
    cols = 4
    nrows = math.ceil(len(rows) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 2.8 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, rows):
        d = torch.tensor(r["_delta"], dtype=torch.float64)
        if d.numel() and float(d.abs().max()) > 0:
            ax.hist(d.numpy(), bins=60, color="tab:blue")
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "δ = 0 on every token", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{r['axis']}: {r['setting']}  mean|δ|={r['mean_abs_delta']:.1e}", fontsize=9)
        ax.set_xlabel("δ = log π_l − log π_s", fontsize=8)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    fig.tight_layout()
    hist = out_dir / "delta_hist.png"
    fig.savefig(hist, dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    floor = 1e-12
    for i, r in enumerate(rows):
        div = [max(v, floor) for v in r["layers"]["divergence"]]
        style = ("-", "--", ":")[i % 3]
        ax.plot(
            range(len(div)),
            div,
            style,
            marker="o",
            color=plt.cm.tab20(i % 20),
            label=f"{r['axis']}: {r['setting']}",
        )
    ax.axhline(table["layer_threshold"], color="gray", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel(f"relative divergence ‖h_l − g_l‖ / ‖g_l‖ (0 drawn at {floor:g})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    layers = out_dir / "layer_divergence.png"
    fig.savefig(layers, dpi=90)
    plt.close(fig)
    return [hist, layers]


def write_gap_table(table: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Write ``gap_table.json`` (rows without the raw δ) and, with ``plots``, the PNGs; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = {**table, "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in table["rows"]]}
    speed = strict_speed(table)
    if speed is not None:
        clean["strict_alignment"] = speed
    path = out_dir / "gap_table.json"
    path.write_text(json.dumps(clean, indent=2))
    written = [path]
    if plots:
        written += plot_gap_table(table, out_dir)
    return written
