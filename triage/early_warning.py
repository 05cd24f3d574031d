"""Early warning: flag a sustained rise of the learner–sampler mismatch in a training log before the reward falls.

NVFP4 runs can collapse late: the learner–sampler gap grows, entropy goes wrong, then reward falls. Three
logged signals see the first part, each watched by a one-sided CUSUM:

* **mean |δ|** (``triage/mean_abs_delta``): the per-token gap. In the mismatch testbed (docs/results.md §3)
  this is the signal that came first: it alarmed before the reward fell in all 9 collapses of vanilla GRPO
  caused by the mismatch alone that had a reward fall (2–59 steps ahead, §3.6), in the 2 collapses of TRIAGE's ``keep-down``
  profile there (9 and 14 ahead) and in the 11 collapses a one-sided correction caused through a mismatch
  feedback (6–87 ahead, §3.3, §3.4, §3.6); in the learning-rate collapses 3 steps after the fall in one and 10
  before it in another (and, rightly, never in the same collapses with no mismatch); 16 false alarms in 78
  runs that did not degrade.
* the **amplify-down share** (``triage/amplify_down/share``: tokens with δ < −τ pushed down by A < 0) and
* the **negative-tail mass** (Σ over amplify-down tokens of |δ| / N = share · |mean δ of the class|, or a
  logged ``triage/negative_tail_mass``). In the testbed the share alarmed later than mean |δ| wherever both
  alarmed, in three collapses only after the reward had fallen, and not at all in the learning-rate
  collapses.

The detector, per signal:

    baseline μ, σ     mean and standard deviation over the first ``warmup`` logged values (σ ≥ min_scale,
                      and ≥ rel_floor·|μ| so a perfectly flat warm-up does not make every wiggle an alarm;
                      for mean |δ| also σ ≥ abs_delta_min_scale, so the noise of an aligned run, |δ| ≈ 1e-6
                      nats, is not a rise)
    z_t = min((x_t − μ) / σ, clip)                    (one outlier adds at most clip − drift)
    S_t = max(0, S_{t−1} + z_t − drift);   alarm at the first step with S_t > threshold

With the defaults (warm-up 50, drift 1, clip 3, threshold 8) a single spike never alarms; at least four
consecutive steps three σ above the baseline (or a longer, smaller rise) do; a flat noisy signal
almost never does (none in the 40 flat synthetic logs of tests/core/test_early_warning.py). The
reward gets the same detector on −reward, so a report states whether the first alarm came before the reward
fall, and by how many steps. A non-finite value is an immediate alarm for its signal (a NaN metric is itself
a symptom). Pure stdlib: reads JSON lines, a JSON list of records, or a TRL/transformers
``trainer_state.json`` (``log_history``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "SIGNALS",
    "Alarm",
    "Cusum",
    "EarlyWarning",
    "EarlyWarningConfig",
    "EarlyWarningReport",
    "read_log",
    "scan_log",
]

SIGNALS = ("mean_abs_delta", "amplify_down_share", "negative_tail_mass")


@dataclass(frozen=True)
class EarlyWarningConfig:
    """Keys of the log and the detector's constants (see the module docstring)."""

    share_key: str = "triage/amplify_down/share"
    delta_key: str = "triage/amplify_down/mean_delta"
    mass_key: str = "triage/negative_tail_mass"
    abs_delta_key: str = "triage/mean_abs_delta"
    reward_key: str = "reward"
    step_key: str = "step"
    warmup: int = 50
    threshold: float = 8.0
    drift: float = 1.0
    clip: float = 3.0
    min_scale: float = 1e-9
    rel_floor: float = 0.02
    abs_delta_min_scale: float = 1e-3

    def __post_init__(self) -> None:
        if not (isinstance(self.warmup, int) and self.warmup >= 2):
            raise ValueError(f"EarlyWarningConfig.warmup must be an int >= 2, got {self.warmup!r}")
        for name in ("threshold", "drift", "clip", "min_scale", "rel_floor", "abs_delta_min_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"EarlyWarningConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.clip <= self.drift:
            raise ValueError(f"EarlyWarningConfig.clip={self.clip} must exceed drift={self.drift}")


@dataclass(frozen=True)
class Alarm:
    signal: str
    step: int
    value: float
    baseline: float
    reason: str


class Cusum:
    """One-sided upper CUSUM on one signal with a warm-up baseline."""

    def __init__(self, name: str, config: EarlyWarningConfig, min_scale: float | None = None) -> None:
        self.name, self.config = name, config
        self.min_scale = config.min_scale if min_scale is None else max(min_scale, config.min_scale)
        self.warm: list[float] = []
        self.mean = self.scale = None
        self.stat = 0.0
        self.alarm: Alarm | None = None

    def update(self, step: int, value: float) -> Alarm | None:
        """Feed one value; returns the alarm the first time the signal trips (None otherwise)."""
        if self.alarm is not None:
            return None
        c = self.config
        if not math.isfinite(value):
            self.alarm = Alarm(
                self.name, step, value, self.mean if self.mean is not None else math.nan, "non-finite value"
            )
            return self.alarm
        if self.mean is None:
            self.warm.append(value)
            if len(self.warm) == c.warmup:
                self.mean = sum(self.warm) / len(self.warm)
                var = sum((v - self.mean) ** 2 for v in self.warm) / (len(self.warm) - 1)
                self.scale = max(math.sqrt(var), self.min_scale, c.rel_floor * abs(self.mean))
            return None
        z = min((value - self.mean) / self.scale, c.clip)
        self.stat = max(0.0, self.stat + z - c.drift)
        if self.stat > c.threshold:
            self.alarm = Alarm(
                self.name, step, value, self.mean, f"sustained rise: CUSUM {self.stat:.1f} > {c.threshold}"
            )
            return self.alarm
        return None


def _number(record: Mapping, key: str, step: int) -> float | None:
    if key not in record or record[key] is None:
        return None
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"log step {step}: {key!r} is {value!r}, not a number")
    return float(value)


@dataclass
class EarlyWarningReport:
    """First alarm per signal, the reward-fall step and the lead (reward fall − first alarm)."""

    alarms: dict[str, Alarm] = field(default_factory=dict)
    reward_fall: Alarm | None = None
    steps: int = 0
    armed: int = 0  # tail signals whose warm-up baseline is complete (0: nothing was watched)
    warmup: int = 50

    @property
    def first_alarm(self) -> Alarm | None:
        return min(self.alarms.values(), key=lambda a: a.step, default=None)

    @property
    def lead_steps(self) -> int | None:
        """Steps between the first alarm and the reward fall (> 0: the warning came first)."""
        first = self.first_alarm
        if first is None or self.reward_fall is None:
            return None
        return self.reward_fall.step - first.step

    def summary(self) -> str:
        if not self.alarms and not self.armed:
            line = (
                f"early warning: not evaluated — no mismatch metric (triage/mean_abs_delta, "
                f"triage/amplify_down/*) reached the {self.warmup}-value warm-up in {self.steps} logged steps"
            )
        elif not self.alarms:
            line = f"early warning: no sustained rise of the mismatch in {self.steps} logged steps"
        else:
            parts = [
                f"{a.signal} at step {a.step} ({a.reason}; {a.value:.4g} vs baseline {a.baseline:.4g})"
                for a in self.alarms.values()
            ]
            line = "early warning: " + "; ".join(parts)
        if self.reward_fall is not None:
            line += f"\nreward fell from step {self.reward_fall.step}"
            lead = self.lead_steps
            if lead is not None and lead >= 0:
                line += f" — {lead} steps after the first alarm"
            elif lead is not None:
                line += f" — {-lead} steps BEFORE the first alarm (no early warning)"
        return line


class EarlyWarning:
    """Streaming detector: call :meth:`update` with each logged record (a dict of metrics)."""

    def __init__(self, config: EarlyWarningConfig | None = None) -> None:
        self.config = config or EarlyWarningConfig()
        floors = {"mean_abs_delta": self.config.abs_delta_min_scale}
        self.detectors = {name: Cusum(name, self.config, floors.get(name)) for name in SIGNALS}
        self.reward = Cusum("reward_fall", self.config)
        self.report = EarlyWarningReport(warmup=self.config.warmup)
        self._last_step: int | None = None

    def signals(self, record: Mapping, step: int) -> dict[str, float]:
        c = self.config
        out = {}
        abs_delta = _number(record, c.abs_delta_key, step)
        if abs_delta is not None:
            out["mean_abs_delta"] = abs_delta
        share = _number(record, c.share_key, step)
        if share is not None:
            out["amplify_down_share"] = share
        mass = _number(record, c.mass_key, step)
        if mass is None and share is not None:
            delta = _number(record, c.delta_key, step)
            if delta is not None:
                mass = share * abs(delta)
        if mass is not None:
            out["negative_tail_mass"] = mass
        return out

    def update(self, record: Mapping, step: int | None = None) -> list[Alarm]:
        """Feed one log record; returns the alarms it raised. Steps must increase."""
        if not isinstance(record, Mapping):
            raise ValueError(f"log record must be a mapping of metrics, got {type(record).__name__}")
        if step is None:
            step = record.get(self.config.step_key)
            if step is None:
                step = 0 if self._last_step is None else self._last_step + 1
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"log steps must increase: step {step} comes after step {self._last_step}")
        self._last_step = step
        self.report.steps += 1
        raised = []
        for name, value in self.signals(record, step).items():
            alarm = self.detectors[name].update(step, value)
            if alarm is not None:
                self.report.alarms[name] = alarm
                raised.append(alarm)
        self.report.armed = sum(d.mean is not None for d in self.detectors.values())
        reward = _number(record, self.config.reward_key, step)
        if reward is not None:
            fall = self.reward.update(step, -reward)
            if fall is not None:
                self.report.reward_fall = Alarm(
                    "reward_fall", step, reward, -(self.reward.mean or 0.0), fall.reason
                )
        return raised


def read_log(path: str | os.PathLike) -> list[dict]:
    """Records from JSON lines, a JSON list, or a ``trainer_state.json`` (its ``log_history``)."""
    text = open(path, encoding="utf-8").read()
    stripped = text.lstrip()
    if stripped.startswith("{") and "\n{" not in stripped.rstrip():
        data = json.loads(text)
        if isinstance(data, dict) and "log_history" in data:
            return list(data["log_history"])
        return [data]
    if stripped.startswith("["):
        return list(json.loads(text))
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON record ({err.msg})") from None
    return records


def scan_log(records: Iterable[Mapping], config: EarlyWarningConfig | None = None) -> EarlyWarningReport:
    """Run the detector over a whole log; records without any tracked key are skipped (e.g. eval lines)."""
    watcher = EarlyWarning(config)
    c = watcher.config
    keys = (c.abs_delta_key, c.share_key, c.mass_key, c.reward_key)
    for record in records:
        if any(k in record for k in keys):
            watcher.update(record)
    return watcher.report
