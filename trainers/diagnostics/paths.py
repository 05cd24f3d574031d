"""Execution paths: score the same tokens the way a learner does and the way a sampler does.

* learner (``kind="learner"``): one full-sequence forward over prompt + completion, as a trainer
  recomputes old log-probs;
* sampler (``kind="sampler"``): prefill the prompt, then feed the completion one token per step through a
  KV cache (``kv_cache``: ``"native"`` (the model dtype), ``"bf16"`` or ``"fp8"``), reading each token's
  log-prob from the logits of the step that produced it, as an inference engine reports it.

Both read ``log softmax(z / T)[y_t]`` from fp32 logits, feed explicit position ids (left-padded prompts
keep positions 0, 1, ...) and record every decoder layer's output with forward hooks, so two paths can be
compared token by token (δ) and layer by layer (:mod:`.localize`).

Each path gets its own copy of the master model (``prepare_model``): cast to the path's dtype, Linear
layers converted by its :class:`~.precision.Precision`.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from triage.trainers.sampling.kvcache import GRANULARITIES, KV_FORMATS, cache_argument, kv_cache

from .precision import Precision, convert_linears
from .strict import strict_alignment

__all__ = ["KINDS", "ExecutionPath", "PathResult", "TokenBatch", "prepare_model", "run_path"]

KINDS = ("learner", "sampler")


@dataclass(frozen=True)
class ExecutionPath:
    """One engine: how it runs the model (``kind``), its Linear numerics, dtype and KV cache."""

    kind: str = "learner"
    precision: Precision = field(default_factory=Precision)
    dtype: torch.dtype = torch.bfloat16
    kv_cache: str = "native"
    kv_granularity: str = "tensor"
    strict: bool = False
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ExecutionPath.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.precision, Precision):
            raise TypeError(
                f"ExecutionPath.precision must be a Precision, got {type(self.precision).__name__}"
            )
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"ExecutionPath.dtype must be float32, bfloat16 or float16, got {self.dtype}")
        if self.kv_cache not in KV_FORMATS:
            raise ValueError(f"ExecutionPath.kv_cache must be one of {KV_FORMATS}, got {self.kv_cache!r}")
        if self.kv_granularity not in GRANULARITIES:
            raise ValueError(
                f"ExecutionPath.kv_granularity must be one of {GRANULARITIES}, got {self.kv_granularity!r}"
            )
        if self.kind == "learner" and self.kv_cache != "native":
            raise ValueError("ExecutionPath: a learner path has no KV cache (kv_cache must be 'native')")
        if not self.temperature > 0:
            raise ValueError(f"ExecutionPath.temperature must be > 0, got {self.temperature}")

    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")
        kv = f" kv={self.kv_cache}" if self.kind == "sampler" and self.kv_cache != "native" else ""
        strict = " strict" if self.strict else ""
        return f"{self.kind}[{dtype} {self.precision.label()}{kv}{strict}]"


@dataclass
class TokenBatch:
    """Prompts left-padded to ``prompt_width``, completions right-padded: ``[pad… prompt | completion …pad]``.

    ``input_ids``/``attention_mask`` are (B, P + C); completion token t of row i is ``input_ids[i, P + t]``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_width: int

    @classmethod
    def from_lists(
        cls, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
    ) -> TokenBatch:
        if len(prompts) != len(completions) or not prompts:
            raise ValueError(
                f"TokenBatch needs one completion per prompt and at least one row, got {len(prompts)} prompts "
                f"and {len(completions)} completions"
            )
        for i, (p, c) in enumerate(zip(prompts, completions)):
            if len(p) == 0:
                raise ValueError(f"TokenBatch: prompt {i} is empty (the sampler needs a context token)")
            if len(c) == 0:
                raise ValueError(f"TokenBatch: completion {i} is empty (nothing to score)")
        width = max(len(p) for p in prompts)
        length = max(len(c) for c in completions)
        ids = torch.full((len(prompts), width + length), int(pad_id), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids[i, width - len(p) : width] = torch.tensor(list(p))
            ids[i, width : width + len(c)] = torch.tensor(list(c))
            mask[i, width - len(p) : width + len(c)] = 1
        return cls(ids, mask, width)

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width :]

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompt_width :].bool()

    @property
    def input_mask(self) -> torch.Tensor:
        """Valid positions among the L − 1 tokens both paths feed (the last completion token never is)."""
        return self.attention_mask[:, :-1].bool()

    def to(self, device) -> TokenBatch:
        return TokenBatch(self.input_ids.to(device), self.attention_mask.to(device), self.prompt_width)


@dataclass
class PathResult:
    """Token log-probs (B, C) (0 at padding), each decoder layer's output (B, L − 1, H) in fp32, time."""

    logps: torch.Tensor
    layers: list[torch.Tensor]
    seconds: float


def prepare_model(
    master: nn.Module, path: ExecutionPath, calibration: dict[str, float] | None = None
) -> nn.Module:
    """A copy of ``master`` in ``path.dtype`` with its Linear layers converted (master untouched)."""
    model = copy.deepcopy(master).to(path.dtype).eval()
    model.requires_grad_(False)
    return convert_linears(
        model, path.precision, calibration=calibration, master=master, learner=path.kind == "learner"
    )


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `.model.layers` ModuleList of decoder layers")
    return layers


class _LayerRecorder:
    """Forward hooks that append every decoder layer's output (fp32) per call."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: list[list[torch.Tensor]] = []
        self.handles = []
        for i, layer in enumerate(_decoder_layers(model)):
            self.outputs.append([])
            self.handles.append(layer.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            self.outputs[i].append(h.detach().float())

        return hook

    def stacked(self) -> list[torch.Tensor]:
        return [torch.cat(chunks, dim=1) for chunks in self.outputs]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def _learner(model: nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    ids, mask, pos, p = batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_width
    out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1], use_cache=False)
    return _token_logps(out.logits[:, p - 1 :], batch.completion_ids, temperature)


@torch.no_grad()
def _sampler(model: nn.Module, batch: TokenBatch, path: ExecutionPath) -> torch.Tensor:
    ids, mask, pos, p = batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_width
    cache = kv_cache(model.config, path.kv_cache, path.kv_granularity, attention_mask=mask[:, :p])
    name = cache_argument(model)
    out = model(
        input_ids=ids[:, :p],
        attention_mask=mask[:, :p],
        position_ids=pos[:, :p],
        use_cache=True,
        **{name: cache},
    )
    logps = [_token_logps(out.logits[:, -1], ids[:, p], path.temperature)]
    for t in range(p, ids.shape[1] - 1):
        out = model(
            input_ids=ids[:, t : t + 1],
            attention_mask=mask[:, : t + 1],
            position_ids=pos[:, t : t + 1],
            use_cache=True,
            **{name: cache},
        )
        logps.append(_token_logps(out.logits[:, -1], ids[:, t + 1], path.temperature))
    return torch.stack(logps, dim=1)


def run_path(
    model: nn.Module, path: ExecutionPath, batch: TokenBatch, capture_layers: bool = True
) -> PathResult:
    """Score ``batch``'s completions with a model prepared for ``path`` (see :func:`prepare_model`)."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    recorder = _LayerRecorder(model) if capture_layers else None
    strict = strict_alignment(model) if path.strict else contextlib.nullcontext()
    start = time.perf_counter()
    try:
        with strict:
            if path.kind == "learner":
                logps = _learner(model, batch, path.temperature)
            else:
                logps = _sampler(model, batch, path)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        if recorder is not None:
            recorder.remove()
    seconds = time.perf_counter() - start
    logps = torch.where(batch.completion_mask, logps, torch.zeros((), device=device))
    bad = ~torch.isfinite(logps)
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(f"{path.label()}: non-finite log-prob at row {row}, completion position {col}")
    layers = recorder.stacked() if recorder is not None else []
    return PathResult(logps, layers, seconds)
