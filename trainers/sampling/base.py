"""What every sampler source shares: sampling parameters, prompt encoding, weight-sync trigger, validation.

A sampler source is a TRL 1.16 ``rollout_func``: ``source(prompts, trainer) -> dict``. It receives the
per-process slice of the generation batch, each prompt already repeated ``num_generations`` times
(contiguous), raw (chat prompts stay message lists), and returns one completion per entry:

* ``prompt_ids``: ``list[list[int]]``, unpadded, the chat template applied like TRL does;
* ``completion_ids``: ``list[list[int]]``, the EOS included when the completion terminated;
* ``logprobs``: ``list[list[float]]``, one per completion token: the sampled token's log-probability under the
  sampler. Which distribution that is depends on the engine; see ``docs/sampling.md``. TRL's learner
  computes ``log_softmax(logits / temperature)`` (temperature only, no top-k/top-p), so that is what the
  built-in HF sampler reports by default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .validation import validate_rollout


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs shared by all engines. ``top_k=0`` and ``top_p=1`` switch truncation off.

    ``from_args`` reads them from a TRL ``GRPOConfig`` (``max_completion_length``, ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repetition_penalty``).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature!r} (the learner divides logits by it; "
                "greedy decoding has no log-prob to correct against)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    @classmethod
    def from_args(cls, args: Any) -> SamplingParams:
        """The sampling parameters of a TRL ``GRPOConfig`` (or any object with the same field names).

        ``args.generation_kwargs`` overrides them like TRL does (``max_new_tokens``/``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``); any other key is an error
        rather than silently ignored: pass engine-specific options to the source itself.
        """
        if getattr(args, "max_completion_length", None) is None:
            raise ValueError("the sampler sources need args.max_completion_length (an int >= 1), got None")
        values = dict(
            max_new_tokens=int(args.max_completion_length),
            temperature=float(args.temperature),
            top_p=float(getattr(args, "top_p", 1.0) or 1.0),
            top_k=int(getattr(args, "top_k", 0) or 0),
            min_p=getattr(args, "min_p", None),
            repetition_penalty=float(getattr(args, "repetition_penalty", 1.0) or 1.0),
        )
        extra = dict(getattr(args, "generation_kwargs", None) or {})
        if "max_tokens" in extra:
            extra["max_new_tokens"] = extra.pop("max_tokens")
        unknown = sorted(k for k in extra if k not in values)
        if unknown:
            raise ValueError(
                f"generation_kwargs {unknown} are not understood by the sampler sources (known: {sorted(values)}); "
                "pass engine options to the source (extra_sampling_params / extra_body)"
            )
        off = {"top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}  # None in generation_kwargs means "off"
        for key, value in extra.items():
            if value is None and key in off:
                value = off[key]
            elif value is None and key != "min_p":
                raise ValueError(f"generation_kwargs[{key!r}] is None; give a number")
            values[key] = value
        return cls(**values)

    @property
    def truncates(self) -> bool:
        """Whether sampling is restricted to a subset of the vocabulary (top-k, top-p or min-p)."""
        return self.top_k > 0 or self.top_p < 1 or bool(self.min_p)


def is_chat_prompt(prompt: Any) -> bool:
    """A chat prompt is a list of ``{"role": ..., "content": ...}`` messages (TRL's conversational format)."""
    return (
        isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]
    )


def encode_prompts(
    prompts: Sequence[Any],
    processing_class: Any,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    tools: list | None = None,
) -> list[list[int]]:
    """Token ids of each prompt, the way TRL 1.16 ``GRPOTrainer._tokenize_prompts`` builds them.

    Chat prompts: ``apply_chat_template(..., add_generation_prompt=True)``; text prompts: the tokenizer's
    ``input_ids`` (with its default special tokens).
    """
    if not prompts:
        return []
    chat = [is_chat_prompt(p) for p in prompts]
    if all(chat):
        enc = processing_class.apply_chat_template(
            conversation=list(prompts),
            tools=tools or None,
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(chat_template_kwargs or {}),
        )
        return [list(map(int, ids)) for ids in enc["input_ids"]]
    if any(chat):
        first = chat.index(not chat[0])
        raise ValueError(
            f"prompt entries mix chat and text prompts (entry 0 vs entry {first}); use one format"
        )
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise ValueError(
            f"prompt entry {bad[0]} is a {type(prompts[bad[0]]).__name__}; expected a string or a list of "
            "{'role', 'content'} messages"
        )
    return [list(map(int, ids)) for ids in processing_class(text=list(prompts))["input_ids"]]


def trainer_prompt_ids(prompts: Sequence[Any], trainer: Any) -> list[list[int]]:
    """``encode_prompts`` with the trainer's processing class, chat template, template kwargs and tools."""
    return encode_prompts(
        prompts,
        trainer.processing_class,
        chat_template=getattr(trainer, "chat_template", None),
        chat_template_kwargs=getattr(trainer, "chat_template_kwargs", None)
        or getattr(trainer.args, "chat_template_kwargs", None),
        tools=getattr(trainer, "tools", None),
    )


def trainer_eos_ids(trainer: Any) -> list[int]:
    """The ids that end a completion: TRL's ``trainer.eos_token_ids`` (tokenizer EOS + the model's EOS ids)."""
    ids = getattr(trainer, "eos_token_ids", None)
    if ids is None:
        ids = [trainer.processing_class.eos_token_id]
    return [int(i) for i in ids if i is not None]


def trainer_rank(trainer: Any) -> int:
    """This process's index (0 without an accelerator); offsets seeds so ranks do not draw the same samples."""
    accelerator = getattr(trainer, "accelerator", None)
    return int(getattr(accelerator, "process_index", 0) or 0)


RANK_SEED_STRIDE = 1_000_003  # seed offset between processes


def trainer_vocab_size(trainer: Any) -> int:
    """Number of rows of the learner's embedding (the model config's ``vocab_size``; the tokenizer as fallback)."""
    model = getattr(trainer, "model", None)
    config = getattr(model, "config", None)
    if config is not None:
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text_config, "vocab_size", None):
            return int(text_config.vocab_size)
    return len(trainer.processing_class)


class SamplerSource:
    """Base of all sources: ``__call__`` is the TRL ``rollout_func``; subclasses implement :meth:`generate`.

    Args:
        params: sampling parameters; ``None`` reads them from ``trainer.args`` at every call.
        weight_sync: ``weight_sync(trainer)`` is called before the first rollout and whenever
            ``trainer.state.global_step`` changed since the last call; it must make the engine serve the
            trainer's current weights (the HF sampler syncs its own copy; servers need your hook, e.g. a
            ``/update_weights_from_disk`` call after saving).
        validate: run :func:`validate_rollout` on every output (on by default; switch off only to debug).
            Inside ``TriageGRPOTrainer`` the trainer still validates the rollout whenever it uses the sampler
            log-probs (any correction but ``none``, or mismatch metrics on): δ must never see a NaN.
    """

    name = "source"

    def __init__(
        self,
        params: SamplingParams | None = None,
        weight_sync: Callable[[Any], None] | None = None,
        validate: bool = True,
    ):
        self.params = params
        self.weight_sync = weight_sync
        self.validate = validate
        self._synced_step: int | None = None
        self.rank = 0  # process index, set from the trainer at every call (seed offsets)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, eos_ids: Sequence[int]) -> dict:
        """Sample one completion per prompt: ``{"completion_ids": [...], "logprobs": [...]}``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """This process's random-stream position (JSON-serialisable), saved in every checkpoint so that a
        resumed run draws the completions the uninterrupted run would have drawn. Empty by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (called on resume, before the first rollout)."""

    def params_for(self, trainer: Any) -> SamplingParams:
        return self.params if self.params is not None else SamplingParams.from_args(trainer.args)

    def maybe_sync_weights(self, trainer: Any) -> None:
        """Call :meth:`sync_weights` when the trainer's ``global_step`` differs from the last synced one."""
        step = int(trainer.state.global_step)
        if self._synced_step != step:
            self.sync_weights(trainer)
            self._synced_step = step

    def sync_weights(self, trainer: Any) -> None:
        if self.weight_sync is not None:
            self.weight_sync(trainer)

    def finish(self, output: dict, prompts: Sequence[Any], trainer: Any) -> dict:
        """Validate ``output`` against the trainer's vocabulary and EOS ids, then return it."""
        if self.validate:
            validate_rollout(
                output, trainer_vocab_size(trainer), eos_ids=trainer_eos_ids(trainer), prompts=prompts
            )
        return output

    def __call__(self, prompts: list, trainer: Any) -> dict:
        self.rank = trainer_rank(trainer)
        self.maybe_sync_weights(trainer)
        prompt_ids = trainer_prompt_ids(prompts, trainer)
        out = self.generate(prompt_ids, self.params_for(trainer), trainer_eos_ids(trainer))
        return self.finish({"prompt_ids": prompt_ids, **out}, prompts, trainer)
