"""``TriageGRPOTrainer``: TRL 1.16's ``GRPOTrainer`` with the TRIAGE mismatch correction.

Swap ``GRPOTrainer`` → ``TriageGRPOTrainer`` and ``GRPOConfig`` → ``TriageGRPOConfig``; nothing else changes.
Per training micro-batch, inside TRL's own ``_compute_loss``:

    δ_t   = log π_learner(y_t) − log π_sampler(y_t)           (``triage.token_gap``)
    w_t   = token_weights(δ, A, mask, config, τ, sampler_logps=log π_sampler)   (detached, 0 at padding)
    ℓ_t  ←  w_t · ℓ_t                                          (ℓ_t: TRL's per-token loss, any loss_type)

then TRL aggregates ℓ with its normaliser for the loss type (weighted-down tokens stay in the normaliser) and
adds its KL / entropy terms unweighted.

**Where the weights enter.** TRL multiplies its per-token loss by ``get_off_policy_mask(...)`` right after
the loss-type surrogate, for every loss type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo), when
``off_policy_mask_threshold`` is set. This trainer overrides that hook to return ``w`` (times TRL's own OPSM
mask when the user set a threshold) and enables it for the duration of ``_compute_loss``. So the whole of
TRL's loss code — clipping, normalisers, KL, entropy bonus, metrics — runs unchanged.

**The learner at the sampler's weights.** δ needs log π_learner at the weights that generated the batch.
TRL computes ``old_per_token_logps`` (no grad) exactly when the weights may have moved since generation
(``gradient_accumulation_steps % (steps_per_generation · num_iterations) != 0``); δ uses them then.
Otherwise no optimizer step separates generation from this micro-batch, so the current forward *is* the
learner at the sampler's weights and δ uses ``per_token_logps.detach()`` (the identity TRL itself relies on
to skip that forward) — no extra forward pass, which keeps the overhead to elementwise work.

**Metrics.** ``triage/...`` sums are all-reduced (SUM) across processes before the ratios are taken; δ
quantiles come from the gathered δ of all processes; ``triage/tau`` is the τ in force. With
``tau="auto"`` the tracker is updated once per optimizer step from the gathered window δ (same value on every
rank) and saved with each checkpoint (``triage_state.json``).

**Input rules** (errors name the sample: its index in this process's generation batch): sampler log-probs
must be present when ``correction != "none"``, one per completion token, finite and ≤ 0 (1e-4 slack); token
ids must be inside the vocabulary; a completion must not be empty (at least EOS). A group whose rewards are
all equal has advantage 0: its tokens are ``inert`` (no policy gradient whatever their weight), counted in the
``triage/inert/share`` metric. When the sampler log-probs are used, an active ``nn.Dropout`` (e.g. LoRA's
``lora_dropout``) needs ``disable_dropout=True``: the learner's train-mode forward would count it as δ.

**Rewards** (checked on the gathered rewards, so every process raises the same error, naming the reward
function and the sample): a reward function may return ``None`` for a sample it does not score (TRL's rule:
TRL stores it as NaN and leaves it out of the group statistics), but not NaN, ±inf, or a reward, or weighted
sum of a sample's rewards, beyond ``REWARD_MAX`` = 1e18 in magnitude; a reward model must return finite
scores within it. TRL would turn each of these into NaN advantages or an overflowing group std and then
into advantages of 0 (``nan_to_num``), silently dropping the whole group.

**Resuming inside a generation window.** TRL generates once per ``steps_per_generation · num_iterations``
micro-steps and trains on the buffered batch in between. A checkpoint saved inside such a window also stores
this process's buffer and micro-step counter (``generation_buffer_<rank>.pt``), so the resumed run trains on
the same completions as the uninterrupted one; a checkpoint inside a window without that file is refused
(resuming would regenerate mid-window and diverge). A checkpoint whose saved TRIAGE config differs from the
run's gets a warning listing the fields (old → new).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather
from trl import GRPOTrainer
from trl.trainer.utils import is_async_callable

from triage import (
    AdaptiveTau,
    TriageConfig,
    delta_quantiles,
    metrics_from_sums,
    mismatch_sums,
    token_gap,
    token_weights,
)

from .config import TriageGRPOConfig, quant_recipe_from
from .sampling.base import SamplerSource, trainer_vocab_size
from .sampling.validation import RolloutValidationError, prompt_head, validate_rollout

TRIAGE_STATE_FILE = "triage_state.json"
SAMPLER_STATE_FILE = "sampler_state_{rank}.json"  # per process: each rank's sampler draws its own stream
GENERATION_STATE_FILE = "generation_buffer_{rank}.pt"  # per process: a checkpoint inside a generation window
# Largest |reward| (and |weighted sum of a sample's rewards|): TRL's fp32 group std squares deviations from
# the group mean, (2 · 1e18)² · 2 (Bessel) < 3.4e38 = fp32 max; beyond that the std overflows to inf and
# every advantage of the group becomes 0.
REWARD_MAX = 1e18


def check_rewards(
    rewards: torch.Tensor,
    explicit_nan: torch.Tensor,
    names: list[str],
    weights: torch.Tensor,
    nan_means_missing: list[bool],
    describe_sample: Callable[[int], str],
) -> None:
    """Raise ``ValueError`` naming the reward function and the sample for a reward TRL would silently turn into
    zero advantages (module docstring, "Rewards"). One host sync.

    ``rewards`` (N, F) fp32 as TRL gathers them (``None`` → NaN); ``explicit_nan`` (N, F) where a function
    returned NaN itself; ``nan_means_missing[f]``: whether NaN in column f can stand for ``None`` (a reward
    function, not a reward model); ``describe_sample(row)`` words a gathered row."""
    may_be_missing = torch.tensor(nan_means_missing, device=rewards.device)[None, :]
    nan = torch.isnan(rewards)
    bad = explicit_nan | (nan & ~may_be_missing) | (~nan & ~(rewards.abs() <= REWARD_MAX))
    total = (rewards * weights.to(rewards.device)[None, :]).nansum(dim=1)
    too_large = ~(total.abs() <= REWARD_MAX)
    any_bad, any_too_large = torch.stack([bad.any(), too_large.any()]).tolist()
    if any_bad:
        row, col = bad.nonzero()[0].tolist()
        value = rewards[row, col].item()
        raise ValueError(
            f"reward function {names[col]!r} returned {value} for {describe_sample(row)}: a reward must be a"
            f" finite number with |reward| <= {REWARD_MAX:g} (None marks a sample the function does not score);"
            f" {int(bad.sum())} such reward(s) in this batch. TRL would silently turn it into advantages of 0"
        )
    if not any_too_large:
        return
    row = int(too_large.nonzero()[0, 0])
    parts = ", ".join(f"{n}={rewards[row, i].item():g}" for i, n in enumerate(names))
    raise ValueError(
        f"the weighted sum of the rewards of {describe_sample(row)} is {total[row].item():g} ({parts}):"
        f" beyond {REWARD_MAX:g}, TRL's group std overflows and every advantage of the group becomes 0"
    )


def _torch_dtype(value, where: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    resolved = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"{where}={value!r} is not a torch dtype (e.g. 'bfloat16', 'float16')")
    return resolved


def resolve_sampler_kwargs(kind: str, kwargs: dict | None) -> dict:
    """``TriageGRPOConfig.sampler_kwargs`` (YAML-friendly) → keyword arguments of ``make_sampler(kind, ...)``.

    * ``dtype`` by name (``"bfloat16"``) becomes a torch dtype.
    * For ``kind="hf"``, the sampler-numerics keys of the recipes (docs/experiments.md) become an
      ``HFSampler`` copy: ``precision: bf16`` (a bf16 copy) or ``precision: nvfp4`` with ``quant_recipe``
      (``QuantRecipe`` fields; the copy is converted with ``triage.kernels.convert`` and
      ``NVFP4Config.from_recipe``);
      ``kv_cache_dtype`` (``auto``/``native``/``bf16``/``fp8_e4m3``) goes to ``HFSampler`` (an emulated fp8 cache,
      see ``triage.trainers.sampling.hf``).
    * TRL's patched ``forward`` on the learner never leaks into an HF sampler copy: ``HFSampler`` drops
      instance-level ``forward`` overrides when it builds the copy, before any ``prepare_model``.
    """
    kwargs = dict(kwargs or {})
    if "dtype" in kwargs and kwargs["dtype"] is not None:
        kwargs["dtype"] = _torch_dtype(kwargs["dtype"], "sampler_kwargs.dtype")
    if kind != "hf":
        return kwargs
    precision = kwargs.pop("precision", None)
    quant_recipe = kwargs.pop("quant_recipe", None)
    kv_cache_dtype = kwargs.get("kv_cache_dtype")
    if kv_cache_dtype is not None:
        from .sampling.kvcache import KV_CACHE_DTYPES

        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"sampler_kwargs.kv_cache_dtype={kv_cache_dtype!r}: the HF sampler supports {KV_CACHE_DTYPES} "
                "(its fp8 cache is e4m3 with per-layer scales calibrated on the prefill)"
            )
    if precision not in (None, "bf16", "nvfp4"):
        raise ValueError(f"sampler_kwargs.precision must be 'bf16' or 'nvfp4', got {precision!r}")
    if quant_recipe is not None and precision != "nvfp4":
        raise ValueError("sampler_kwargs.quant_recipe needs sampler_kwargs.precision: nvfp4")
    user_prepare = kwargs.pop("prepare_model", None)
    steps = []
    if precision is not None:
        kwargs["sampler_model"] = "copy"
        kwargs.setdefault("dtype", torch.bfloat16)
    if precision == "nvfp4":
        # the sampler's own recipe (the HF sampler first turns an NVFP4 learner's copy back to high precision)
        from triage.kernels import NVFP4Config, convert

        config = NVFP4Config.from_recipe(quant_recipe_from(quant_recipe, "sampler_kwargs.quant_recipe"))
        steps.append(lambda m: convert(m, config))
    if user_prepare is not None:
        steps.append(user_prepare)
    if steps:

        def prepare_model(model):
            for step in steps:
                model = step(model) or model
            return model

        kwargs["prepare_model"] = prepare_model
    return kwargs


def _check_prompt_column(**datasets) -> None:
    """Every given dataset (``eval_dataset`` may be a dict of them) has the ``"prompt"`` column GRPO samples
    from: a clear error at construction instead of a ``KeyError`` at the first step. A dataset whose columns
    are unknown until iterated (an ``IterableDataset`` without features) is not checked."""
    named = []
    for name, dataset in datasets.items():
        if isinstance(dataset, dict):
            named += [(f"{name}[{key!r}]", d) for key, d in dataset.items()]
        elif dataset is not None:
            named.append((name, dataset))
    for name, dataset in named:
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ValueError(
                f"{name} has no 'prompt' column (columns: {list(columns)}): GRPO samples its completions from "
                "it; rename yours, e.g. dataset.rename_column('question', 'prompt')"
            )


class TriageGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` + TRIAGE (module docstring). Same constructor; ``args`` is a ``TriageGRPOConfig``."""

    def __init__(self, model, reward_funcs=None, args: TriageGRPOConfig | None = None, *posargs, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = TriageGRPOConfig(f"{str(name).split('/')[-1] or 'model'}-TRIAGE-GRPO")
        if not isinstance(args, TriageGRPOConfig):
            raise TypeError(
                f"TriageGRPOTrainer needs a TriageGRPOConfig, got {type(args).__name__}: build one with the same "
                "fields (TriageGRPOConfig(**grpo_config.to_dict()) plus the TRIAGE fields)"
            )
        if posargs:
            raise TypeError("pass TriageGRPOTrainer's arguments after `args` by keyword")
        _check_prompt_column(
            train_dataset=kwargs.get("train_dataset"), eval_dataset=kwargs.get("eval_dataset")
        )
        self.triage_config = args.triage_config()
        self.adaptive_tau = AdaptiveTau(self.triage_config)

        rollout_func = kwargs.pop("rollout_func", None)
        if rollout_func is None and args.sampler is not None:
            from triage.trainers.sampling import make_sampler

            os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # our sources are not experimental
            rollout_func = make_sampler(
                args.sampler, **resolve_sampler_kwargs(args.sampler, args.sampler_kwargs)
            )
        if rollout_func is None and not args.use_vllm and self.triage_config.correction != "none":
            raise ValueError(
                f"correction={self.triage_config.correction!r} needs sampler log-probs, and TRL's transformers "
                "generation returns none: set TriageGRPOConfig.sampler='hf' (the built-in sampler with "
                "per-token log-probs), use_vllm=True, or pass a rollout_func that returns 'logprobs'"
            )
        if rollout_func is not None:
            rollout_func = self._validated(rollout_func)

        lora_on_nvfp4 = kwargs.get("peft_config") is not None and args.learner_precision == "nvfp4"
        if lora_on_nvfp4:
            # QeRL setting: frozen NVFP4 base (quantized bytes only) + PEFT LoRA adapters (docs/trainer.md).
            from triage.kernels import NVFP4Config
            from triage.trainers.peft_nvfp4 import nvfp4_lora_model

            # the activation recipe of a w4a4 base is quant_recipe too (as for the NVFP4 learner)
            config = NVFP4Config.from_recipe(
                quant_recipe_from(args.quant_recipe, "TriageGRPOConfig.quant_recipe"),
                frozen=args.lora_base_mode,
            )
            model, kwargs["peft_config"] = nvfp4_lora_model(
                model,
                kwargs["peft_config"],
                config,
                model_init_kwargs=args.model_init_kwargs if isinstance(model, str) else None,
            )
        if args.use_vllm and not isinstance(model, str):
            from triage.kernels.frozen_linear import FrozenNVFP4Linear

            if any(isinstance(m, FrozenNVFP4Linear) for m in model.modules()):
                raise ValueError(
                    "use_vllm=True cannot train LoRA over a frozen NVFP4 base: TRL's weight sync sends the merged "
                    "named_parameters(), and FrozenNVFP4Linear keeps its weights in buffers, so vLLM would keep "
                    "sampling the initial projections. Use sampler='hf' (it shares the base with the learner), or "
                    "a sampler source with a weight_sync that sends triage.trainers.lora.merged_state_dict(model)"
                )
        if args.aqn is not None:
            from triage.trainers.aqn import AQNCallback, AQNConfig

            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), AQNCallback(AQNConfig(**args.aqn))]

        super().__init__(model, reward_funcs, args, rollout_func=rollout_func, **kwargs)

        if self._uses_sampler_logps and not args.disable_dropout:
            dropout = [
                n for n, m in self.model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0
            ]
            if dropout:
                raise ValueError(
                    f"the model has active dropout ({dropout[0]!r}, {len(dropout)} module(s), e.g. LoRA's "
                    "lora_dropout): the learner's log-probs come from a train-mode forward with dropout while the "
                    "sampler's do not, so dropout noise would be counted as mismatch δ. Set disable_dropout=True "
                    "(TriageGRPOConfig, from GRPOConfig) or lora_dropout=0"
                )
        if args.learner_precision == "nvfp4" and not lora_on_nvfp4:
            self._convert_learner_to_nvfp4(args.quant_recipe)
        self._triage_inputs: dict[str, Any] | None = None
        self._tau_window: list[torch.Tensor] = []

    # --- sampler output validation -------------------------------------------------------------------------

    @property
    def _needs_sampler_logps(self) -> bool:
        return self.triage_config.correction != "none"

    @property
    def _uses_sampler_logps(self) -> bool:
        return self._needs_sampler_logps or self.args.log_mismatch_metrics

    def _check_rollout(
        self, prompts, prompt_ids, completion_ids, logprobs, source: str, env_mask=None
    ) -> None:
        """``validate_rollout`` (sample-named errors) when TRIAGE uses the sampler log-probs; pure TRL otherwise.
        ``env_mask``: a multi-turn ``rollout_func``'s (TRL's) model-vs-environment token mask."""
        if not self._uses_sampler_logps:
            return
        if logprobs is None:
            if self._needs_sampler_logps:
                raise ValueError(
                    f"{source} returned no sampler log-probs, but correction={self.triage_config.correction!r} "
                    "needs them (see TriageGRPOConfig.sampler)"
                )
            return
        rollout = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}
        try:
            validate_rollout(
                rollout,
                trainer_vocab_size(self),
                eos_ids=self.eos_token_ids,
                prompts=prompts,
                env_mask=env_mask,
            )
        except RolloutValidationError as err:
            raise RolloutValidationError(f"{source}: {err}") from None

    def _validated(self, rollout_func: Callable) -> Callable:
        if isinstance(rollout_func, SamplerSource) and rollout_func.validate:
            return rollout_func  # our sources validate their own output

        name = getattr(rollout_func, "__name__", type(rollout_func).__name__)

        def validated_rollout(prompts, trainer):
            output = rollout_func(prompts, trainer)
            if isinstance(output, dict) and {"prompt_ids", "completion_ids", "logprobs"} <= output.keys():
                trainer._check_rollout(
                    prompts,
                    output["prompt_ids"],
                    output["completion_ids"],
                    output["logprobs"],
                    f"rollout_func {name}",
                    env_mask=output.get("env_mask"),
                )
            return output

        validated_rollout.inner = rollout_func
        return validated_rollout

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        source = "vLLM" if self.use_vllm else "transformers generate"
        self._check_rollout(None, prompt_ids, completion_ids, logprobs, source)
        return completion_ids, logprobs

    # --- rewards ---------------------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (gathered over processes), refusing the rewards of ``check_rewards``."""
        explicit_nan = torch.zeros(len(prompts), len(self.reward_funcs), dtype=torch.bool)
        funcs = self.reward_funcs
        self.reward_funcs = [
            f if isinstance(f, torch.nn.Module) else _marking_nan(f, explicit_nan[:, i])
            for i, f in enumerate(funcs)
        ]
        try:
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        n_local, rank = len(prompts), self.accelerator.process_index
        several = self.accelerator.num_processes > 1

        def describe_sample(row: int) -> str:
            process, index = divmod(row, n_local)
            where = f"sample {index}" + (f" of process {process}" if several else "")
            return where + (f" (prompt {prompt_head(prompts[index])!r})" if process == rank else "")

        check_rewards(
            rewards,
            gather(explicit_nan.to(rewards.device, torch.uint8)).bool(),  # uint8: every backend gathers it
            self.reward_func_names,
            self.reward_weights,
            [not isinstance(f, torch.nn.Module) for f in funcs],
            describe_sample,
        )
        return rewards

    # --- NVFP4 learner -------------------------------------------------------------------------------------

    def _convert_learner_to_nvfp4(self, quant_recipe) -> None:
        """Replace the learner's Linear layers and fused MoE experts by NVFP4 ones in place
        (``triage.kernels.convert`` with ``NVFP4Config.from_recipe(quant_recipe)``; the layers share the
        learner's parameters, which the optimizer holds)."""
        try:
            from triage.kernels.conversion import NVFP4Config, convert
        except ImportError as err:
            raise ImportError(
                "learner_precision='nvfp4' needs triage.kernels.convert (kernels/conversion.py), which is "
                f"not available in this install: {err}"
            ) from err
        convert(
            self.accelerator.unwrap_model(self.model),
            NVFP4Config.from_recipe(quant_recipe_from(quant_recipe, "TriageGRPOConfig.quant_recipe")),
        )

    # --- the loss ------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        has_sampler = inputs.get("sampling_per_token_logps") is not None
        active = self.triage_config.correction != "none" or self.args.log_mismatch_metrics
        if not (has_sampler and active):
            if self.triage_config.correction != "none":  # generation validated this already; belt and braces
                raise ValueError(
                    f"correction={self.triage_config.correction!r}: the batch has no sampler log-probs"
                )
            return super()._compute_loss(model, inputs)
        # Enable TRL's off-policy-mask hook for this call; `get_off_policy_mask` below returns the weights.
        user_threshold = self.off_policy_mask_threshold
        self.off_policy_mask_threshold = math.inf if user_threshold is None else user_threshold
        self._triage_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.off_policy_mask_threshold = user_threshold
            self._triage_inputs = None

    def get_off_policy_mask(
        self, advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
    ):
        """TRL's hook, called inside ``_compute_loss``: returns TRIAGE weights × (TRL's OPSM mask if set)."""
        keep = 1.0
        if self.args.off_policy_mask_threshold is not None:
            keep = GRPOTrainer.get_off_policy_mask(
                advantages,
                per_token_logps,
                sampling_per_token_logps,
                mask,
                self.args.off_policy_mask_threshold,
            )
        inputs = self._triage_inputs
        if inputs is None:  # called from elsewhere: behave like TRL
            return keep
        with torch.no_grad():
            old = inputs.get("old_per_token_logps")
            learner = per_token_logps.detach() if old is None else old
            if advantages.dim() == 2 and advantages.size(1) == 1:
                advantages = advantages[:, 0]
            sampler = inputs["sampling_per_token_logps"]
            delta = token_gap(learner, sampler, mask)
            tau = self.adaptive_tau.value
            # the band needs the sampler's log-probs only in probability space (token_gap validated them)
            band_logps = sampler if self.triage_config.tau_space == "prob" else None
            weights = token_weights(
                delta, advantages, mask, self.triage_config, tau=tau, sampler_logps=band_logps
            )
            self._observe(delta, advantages, mask, weights, tau, sampler)
        if self.triage_config.correction == "none":
            return keep  # metrics only: the loss is GRPOTrainer's, bit for bit
        return keep * weights.to(per_token_logps.dtype)

    def _observe(self, delta, advantages, mask, weights, tau: float, sampler_logps) -> None:
        """Log the all-reduced ``triage/...`` metrics; feed the adaptive τ the gathered δ of the window.
        ``sampler_logps``: the sampler's log-probs δ came from (probability-space classes, ``mean_abs_dprob``)."""
        mode = "train" if self.model.training else "eval"
        track_tau = mode == "train" and self.triage_config.adaptive
        if not (self.args.log_mismatch_metrics or track_tau):
            return
        all_delta = self.accelerator.gather(self.accelerator.pad_across_processes(delta, dim=1, pad_index=0))
        all_mask = self.accelerator.gather(
            self.accelerator.pad_across_processes(mask, dim=1, pad_index=0)
        ).bool()
        if self.args.log_mismatch_metrics:
            sums = mismatch_sums(
                delta, advantages, mask, weights, self.triage_config, tau=tau, sampler_logps=sampler_logps
            )
            keys = sorted(sums)
            totals = self.accelerator.reduce(torch.stack([sums[k] for k in keys]), reduction="sum")
            metrics = metrics_from_sums(dict(zip(keys, totals.cpu().tolist())))
            metrics.update(delta_quantiles(all_delta, all_mask))
            metrics["triage/tau"] = tau
            for key, value in metrics.items():
                self._metrics[mode][key].append(value)
        if track_tau:
            self._tau_window.append(all_delta[all_mask].abs().float())
            if self.accelerator.sync_gradients:  # end of the accumulation window: one τ update per step
                window = torch.cat(self._tau_window)
                self._tau_window = []
                if window.numel() > 0:
                    self.adaptive_tau.update_from_median(window.median().item())

    # --- checkpoints ---------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        if self.args.should_save:
            state = {
                "adaptive_tau": self.adaptive_tau.state_dict(),
                "triage_config": self.triage_config.to_dict(),
            }
            with open(os.path.join(folder, TRIAGE_STATE_FILE), "w") as f:
                json.dump(state, f, indent=2)
        if self._step % self._generate_every != 0 and self._buffered_inputs is not None:
            # inside a generation window: the rest of the window trains on these completions
            os.makedirs(folder, exist_ok=True)
            name = GENERATION_STATE_FILE.format(rank=self.accelerator.process_index)
            torch.save(
                {"step": self._step, "buffered_inputs": self._buffered_inputs}, os.path.join(folder, name)
            )
        source = self._sampler_source()
        sampler_state = source.state_dict() if source is not None else {}
        if sampler_state:  # every process saves its own (as transformers does for its RNG states)
            os.makedirs(folder, exist_ok=True)
            name = SAMPLER_STATE_FILE.format(rank=self.accelerator.process_index)
            with open(os.path.join(folder, name), "w") as f:
                json.dump(sampler_state, f)

    @property
    def _generate_every(self) -> int:
        """Micro-steps between two generations (TRL's ``_prepare_inputs``)."""
        return self.args.steps_per_generation * self.num_iterations

    def _sampler_source(self) -> SamplerSource | None:
        """The built-in sampler source behind ``rollout_func`` (possibly wrapped by :meth:`_validated`)."""
        source = getattr(self.rollout_func, "inner", self.rollout_func)
        return source if isinstance(source, SamplerSource) else None

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, TRIAGE_STATE_FILE)
        if os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            try:
                self.adaptive_tau.load_state_dict(state["adaptive_tau"])
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from None
            self._compare_triage_config(state.get("triage_config") or {}, checkpoint)
        elif self.triage_config.adaptive:
            raise FileNotFoundError(
                f"{path} is missing: cannot resume the adaptive τ (tau='auto') from checkpoint {checkpoint}"
            )
        self._load_generation_window(checkpoint)
        source = self._sampler_source()
        path = os.path.join(checkpoint, SAMPLER_STATE_FILE.format(rank=self.accelerator.process_index))
        if source is not None and os.path.exists(path):  # absent: a checkpoint from before any rollout
            with open(path) as f:
                source.load_state_dict(json.load(f))

    def _compare_triage_config(self, saved: dict[str, Any], checkpoint: str) -> None:
        """Warn when the checkpoint was trained with another TRIAGE config (a deliberate change is allowed)."""
        now = self.triage_config.to_dict()
        if saved:  # a field added to TriageConfig after the checkpoint was saved: it ran with the default
            saved = {**{k: v for k, v in TriageConfig().to_dict().items() if k not in saved}, **saved}
        changed = [
            f"{k}: {saved.get(k, '(not saved)')!r} → {v!r}" for k, v in now.items() if saved.get(k) != v
        ]
        if changed:
            warnings.warn(
                f"resuming from {checkpoint} with a TRIAGE config that differs from the one it was trained with"
                f" ({'; '.join(changed)}): the resumed run is not a continuation of the saved one",
                stacklevel=2,
            )

    def _load_generation_window(self, checkpoint: str) -> None:
        """Restore the buffered generation batch of a checkpoint saved inside a generation window."""
        path = os.path.join(checkpoint, GENERATION_STATE_FILE.format(rank=self.accelerator.process_index))
        if os.path.exists(path):
            saved = torch.load(path, map_location=self.accelerator.device, weights_only=True)
            self._step, self._buffered_inputs = saved["step"], saved["buffered_inputs"]
            return
        step = self.state.global_step * self.args.gradient_accumulation_steps
        if step % self._generate_every != 0:
            raise ValueError(
                f"checkpoint {checkpoint} was saved inside a generation window (micro-step {step}; TRL generates"
                f" every steps_per_generation · num_iterations = {self._generate_every} micro-steps) and has no"
                f" {os.path.basename(path)}: resuming would regenerate mid-window and diverge from the"
                " uninterrupted run. Resume from a checkpoint saved by TriageGRPOTrainer, or from one at a"
                " generation boundary"
            )


def _marking_nan(func: Callable, explicit_nan: torch.Tensor) -> Callable:
    """``func`` (sync or async, as TRL calls it) that marks in ``explicit_nan`` the samples it returned NaN for
    (not None: TRL turns None into NaN too, and that one means "not scored")."""

    def mark(output):
        for i, reward in enumerate(output):
            try:
                if reward is not None and i < len(explicit_nan) and math.isnan(float(reward)):
                    explicit_nan[i] = True
            except (TypeError, ValueError):  # not a number: TRL's own conversion reports it
                pass
        return output

    if is_async_callable(func):

        async def marking(*args, **kwargs):
            return mark(await func(*args, **kwargs))

    else:

        def marking(*args, **kwargs):
            return mark(func(*args, **kwargs))

    return marking
