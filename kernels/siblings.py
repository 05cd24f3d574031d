"""Sibling layers that read one input run their decode GEMMs as ONE launch.

q/k/v read one hidden state and gate/up another (:data:`~triage.kernels.fused_groups.FUSED_GROUPS`). The
engines run each group as one GEMM (vLLM's ``qkv_proj`` / ``gate_up_proj``); a Hugging Face model calls the
layers one by one. At decode sizes a GEMV costs its launch and its ramp more than its bytes (a ~5 µs floor
on an H100, docs/benchmarks.md "Decode GEMV"), so :func:`link_siblings` (run by
:func:`~triage.kernels.convert`) gives the NVFP4 layers of each group (``NVFP4Linear``,
``FrozenNVFP4Linear``) one :class:`SiblingGroup`. When a member's forward runs the decode kernel (≤
``SMALL_M`` rows, no autograd graph to build), the first member called on an input ``x`` computes every
member's output in one launch (:func:`~triage.kernels.nvfp4.gemm_decode.launch_decode_group`), returns its
own and keeps the others'; each other member gets its output when it is called on the same ``x``.

Rules:

* Same ``x``: the very tensor object, or a view of the same base with the same pointer, shape, strides and
  offset (a compiled graph hands each op its own view of one buffer), unchanged as far as torch can tell
  (:func:`~triage.kernels.linear.input_key`, the rule sibling layers already share x's quantization by:
  version counter, pointer, shape, strides, offset, stream, nothing kept across optimizer steps; inside a
  CUDA-graph capture only within :func:`~triage.kernels.linear.capture_scope`; never for inference tensors,
  which have no version counter: under ``torch.inference_mode()`` every member computes alone, so decode
  under ``torch.no_grad()``, as the built-in sampler and ``generate`` do).
* Same operands: a kept output is handed out only if the member's config, weight (codes, block and outer
  scales; an ``NVFP4Linear``'s cached W_q) and bias are the objects the group launch read, with the same
  version counters (a weight sync, a re-quantized weight or an in-place write in between makes the member
  compute alone). Each kept output is handed out once; a second call computes again.
* Otherwise every member computes alone, as without a group: more rows than ``SMALL_M``, grad mode with an
  input that requires grad, ``torch.compile``, backends that do not run the decode kernel, members whose
  configs differ, a member not on x's device.
* Links are to layer objects: a deep copy or a pickle of a model (or of one layer) loads unlinked; link it
  with :func:`link_siblings` (the built-in sampler links its copy).
* Bits: each output is what the member's own decode launch with the group's tiles and split-K gives; the
  split is chosen for the group's total rows (:func:`~triage.kernels.nvfp4.gemm_decode.decode_config`), so
  it may differ from a lone launch's in the last bits (fp32 partial sums in another order). The outputs are
  contiguous views of one buffer (separate allocations inside a compiled graph's custom ops).
* Under ``torch.compile`` the grad-free forward of each layer is one custom op (``triage::nvfp4_linear``,
  ``triage::frozen_nvfp4_linear``) whose implementation runs the group at run time, under the same-x rule.
  The ops are ``flexible_layout``, so inductor hands the members its one buffer of their input. Where a graph
  still hands them different buffers of equal values, the first member's launch finds its kept outputs
  unclaimed, and the group's ops compute each member alone from then on (``SiblingGroup.compiled_alone``;
  one wasted group launch). Inside ops a kept output is claimed only by the op calls right after the launch
  (compiled code may reuse a buffer object for another value, with the same version counter, in between);
  another op call in between sends the group the same way.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from triage.kernels.fused_groups import FUSED_GROUPS, fused_group_members
from triage.kernels.nvfp4.matmul import SMALL_M

__all__ = ["SiblingGroup", "link_siblings"]


class SiblingGroup:
    """The members (2 or 3 layers, :func:`link_siblings`) of one fused group of one parent module, and the
    outputs the last group launch computed for members not yet called (module docstring)."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        if not 2 <= len(members) <= 3:
            raise ValueError(f"SiblingGroup: 2 or 3 members, got {len(members)}")
        self.members = list(members)
        self._kept: tuple | None = None  # (weakref to x, input_key(x), {member index: (y, weight token)})
        #: a compiled graph handed the members different input buffers of equal values: its custom ops
        #: compute each member alone from then on
        self.compiled_alone = False
        self._unclaimed: set[int] = set()  # members a compiled-graph launch computed for, not yet called
        self._serial = self._claims = 0  # the launching op call's serial, the claims since (inside ops)
        #: the last launch's plan: (signature, the members' weight tokens, (widths, DecodeLaunch, checked
        #: weight operands) or None where they do not fit one launch); see :meth:`_plan_for`. Kept for frozen
        #: layers only: an NVFP4Linear's W_q is re-quantized into new tensors after every optimizer step, which
        #: a kept plan would hold on to
        self._plan: tuple | None = None
        from triage.kernels.frozen_linear import FrozenNVFP4Linear

        self._keeps_plan = all(isinstance(m, FrozenNVFP4Linear) for m in self.members)

    def output(self, layer: nn.Module, x: torch.Tensor, separate: bool = False) -> torch.Tensor | None:
        """``layer``'s forward output on ``x`` from the group's launch (made now, or kept from the launch a
        sibling made on the same ``x``), or None: the layer computes alone (module docstring). ``separate``:
        a launch made now gives each member an allocation of its own instead of views of one buffer (what a
        custom op inside a compiled graph must return: inductor may reuse an op output's storage once that
        output is dead)."""
        from triage.kernels import linear

        key = linear.input_key(x)
        index = next((i for i, m in enumerate(self.members) if m is layer), None)
        if key is None or index is None:
            return None
        kept = self._kept
        owner = _owner(x)
        if kept is not None and kept[0]() is owner and kept[1] == key and index in kept[2]:
            if separate:  # inside ops: only the op calls right after the launch claim (a buffer object
                # reused for another value between them would pass the same key)
                self._claims += 1
                if linear._op_serial != self._serial + self._claims:
                    self.compiled_alone, self._kept = True, None
                    return None
            y, token = kept[2].pop(index)
            self._unclaimed.discard(index)
            if not kept[2]:
                self._kept = None
            return y if _same(layer._decode_token(), token) else None
        if separate and (self.compiled_alone or index in self._unclaimed):
            # a compiled graph handed this member another buffer than the sibling that launched for it
            self.compiled_alone, self._kept = True, None
            return None
        outputs = self._launch(x, separate)
        if outputs is None:
            return None
        y, _ = outputs.pop(index)
        self._kept = (weakref.ref(owner, self._forget), key, outputs) if outputs else None
        self._unclaimed = set(outputs) if separate else set()
        self._serial, self._claims = linear._op_serial, 0
        return y

    def _forget(self, ref: weakref.ref) -> None:
        kept = self._kept
        if kept is not None and kept[0] is ref:
            self._kept = None

    def _launch(self, x: torch.Tensor, separate: bool = False) -> dict | None:
        """Every member's output on ``x`` from one decode launch, ``{index: (y, weight token)}``; None when the
        members would not run the decode kernel or their operands do not fit one launch."""
        first = self.members[0]
        config = first.config
        if any(m.config is not config and m.config != config for m in self.members[1:]):
            return None  # one config: one activation (recipe, backends) and one route for all
        act = first._decode_activation(x)
        if act is None:
            return None
        xa, g_a, _ = act
        if xa.shape[0] > SMALL_M:  # a W4A16 prefill (the decode kernel in M tiles): each member alone
            return None
        if self._keeps_plan:  # a kept plan needs the tokens alone
            tokens, weights = [m._decode_token() for m in self.members], None
        else:  # the operands (a learner's W_q refreshed once) and their tokens in one call per member
            decoded = [m._decode_weight() for m in self.members]
            tokens, weights = [d[2] for d in decoded], [d[:2] for d in decoded]
        plan = self._plan_for(x, xa, tokens, weights)
        if plan is None:
            return None
        widths, launch, weights = plan
        rows = xa.shape[0]
        if separate:
            outs = [torch.empty((rows, n), dtype=x.dtype, device=x.device) for n in widths]
        else:
            align = max(1, 16 // x.element_size())  # each output 16-byte aligned, as an allocation is
            sizes = [-(-rows * n // align) * align for n in widths]
            flat = torch.empty(sum(sizes), dtype=x.dtype, device=x.device)
            outs, start = [], 0
            for n, size in zip(widths, sizes):
                outs.append(flat[start : start + rows * n].view(rows, n))
                start += size
        launch.launch_group(xa, weights, outs, g_a)
        lead = tuple(x.shape[:-1])
        return {i: (out.view(*lead, n), token) for i, (out, n, token) in enumerate(zip(outs, widths, tokens))}

    def _plan_for(self, x: torch.Tensor, xa: torch.Tensor, tokens: list, weights) -> tuple | None:
        """``(widths, launch, checked weights)`` of a group launch on ``xa`` (the activation as the kernel
        reads it) for ``x``'s dtype and device, or None where the members' operands do not fit one launch:
        kept from the last launch (frozen members: ``_keeps_plan``) while the signature and every member's
        weight token (its config, tensors and their version counters: ``_decode_token``) are the same, so a
        launch checks and derives its operands once per weight version, not once per call. ``weights``: each
        member's ``(W_q, bias)`` where the caller has them (else read here)."""
        from triage.kernels.nvfp4.gemm_decode import default_launch
        from triage.kernels.nvfp4.matmul import _kernel_scale

        signature = (xa.shape, xa.dtype, x.dtype, x.device)
        kept = self._plan
        if kept is not None and kept[0] == signature and all(_same(t, u) for t, u in zip(tokens, kept[1])):
            return kept[2]
        plan = None
        weights = weights or [m._decode_weight()[:2] for m in self.members]
        widths = tuple(int(w.shape[0]) for w, _ in weights)
        fit = len({w.data.shape[-1] for w, _ in weights}) == 1 and len({_dtype(b) for _, b in weights}) == 1
        # a member moved (offloaded, another device): each computes alone, as it would
        devices = {w.data.device for w, _ in weights} | {b.device for _, b in weights if b is not None}
        fit = fit and devices == {x.device}
        if fit:
            g_bs = [_kernel_scale(w, 1 if _per_tensor(w) else n) for (w, _), n in zip(weights, widths)]
            if len({g.numel() == 1 for g in g_bs}) == 1:
                kb = weights[0][0].scale.shape[-1]  # K below: as the member's own launch takes it
                launch = default_launch(xa.shape[0], widths, xa.shape[1], kb, xa.dtype, x.dtype, x.device)
                checked = launch.group_weights([(w.data, w.scale, g, b) for (w, b), g in zip(weights, g_bs)])
                plan = (widths, launch, checked)
        if self._keeps_plan:
            self._plan = (signature, tokens, plan)
        return plan

    def __deepcopy__(self, memo):
        return None  # links stay with the layers they were made for: a copy is linked again (link_siblings)

    def __reduce__(self):
        return _unlinked, ()  # a pickled layer loads unlinked (its siblings are not pickled with it)


def _owner(x: torch.Tensor) -> torch.Tensor:
    """The tensor whose life the kept outputs follow: ``x``'s base when ``x`` is a view (a compiled graph hands
    each layer its own view object of one buffer, dead right after the call), else ``x`` itself."""
    return x if x._base is None else x._base


def _unlinked() -> None:
    """What a pickled :class:`SiblingGroup` loads as: no group."""
    return None


def _dtype(bias: torch.Tensor | None) -> torch.dtype | None:
    """A bias's dtype (None: no bias): one kernel reads every member's bias through one pointer type."""
    return None if bias is None else bias.dtype


def _per_tensor(w) -> bool:
    g = w.global_scale
    return not isinstance(g, torch.Tensor) or g.numel() == 1


def _same(token: tuple, used: tuple) -> bool:
    """Two weight tokens (``_decode_weight``) of one member are the same: the same objects, equal version
    counts (ints)."""
    return len(token) == len(used) and all(
        a == b if isinstance(a, int) else a is b for a, b in zip(token, used)
    )


def link_siblings(model: nn.Module, fused_groups=FUSED_GROUPS) -> int:
    """Give the NVFP4 layers of ``model`` (``NVFP4Linear``, ``FrozenNVFP4Linear``) in each fused group (the
    layers ``<parent>.<leaf>`` of one parent whose leaves are one entry of ``fused_groups``,
    :func:`~triage.kernels.fused_groups.fused_group_members`) one :class:`SiblingGroup`, where they can run
    as one decode launch: 2 or 3 layers of one class, ``in_features``, config, device, bias dtype (or no bias)
    and outer-scale kind (per tensor or per row), W4A4 with ``share_inputs`` (one activation quantization), not
    ``capturable``; W4A4 with nearest rounding. A layer wrapped by PEFT (``q_proj.base_layer``) counts as its
    wrapper (``q_proj``): LoRA calls its base layer on the wrapper's input. Every link made before is dropped
    first (``fused_groups=()``: unlink all). Links are to the layer objects: they survive wrapping, not
    copying — a deep copy or a pickled model loads unlinked (link it again with this function; the built-in
    sampler links its copy). Returns the number of groups linked."""
    from triage.kernels.frozen_linear import FrozenNVFP4Linear
    from triage.kernels.linear import NVFP4Linear

    # a PEFT-wrapped layer (``q_proj.base_layer``) is its wrapper's shard: the wrapper calls it on its own x
    layers = {
        n.removesuffix(".base_layer"): m
        for n, m in model.named_modules()
        if isinstance(m, (NVFP4Linear, FrozenNVFP4Linear))
    }
    for m in layers.values():
        m._siblings = None
    linked, seen = 0, set()
    for members in fused_group_members(layers, fused_groups).values():
        if members in seen:
            continue
        seen.add(members)
        group = [layers[n] for n in members]
        if 2 <= len(group) <= 3 and _fit(group):
            siblings = SiblingGroup(group)
            for m in group:
                m._siblings = siblings
            linked += 1
    return linked


def _fit(group: list[nn.Module]) -> bool:
    """Whether the layers of ``group`` can share one decode launch (:func:`link_siblings`' conditions)."""
    from triage.kernels.frozen_linear import FrozenNVFP4Linear

    first = group[0]
    if any(type(m) is not type(first) or m.config != first.config for m in group):
        return False
    if len({m.in_features for m in group}) != 1 or len({_dtype(m.bias) for m in group}) != 1:
        return False
    if isinstance(first, FrozenNVFP4Linear):
        devices = {m.qweight.device for m in group}
        kinds = {m.weight_scale_2.numel() == 1 for m in group}
        w4a4 = first.config.compute == "w4a4"
    else:
        devices = {m.weight.device for m in group}
        kinds = {m.config.weight.scale for m in group}
        w4a4 = True
        if first.config.capturable:
            return False
    # W4A4: one activation quantization for all, as share_inputs gives (never for stochastic rounding, where
    # each layer draws its own)
    shared = not w4a4 or (first.config.share_inputs and first.config.activation.rounding == "nearest")
    return len(devices) == 1 and len(kinds) == 1 and shared
