"""Replay rollouts exported by another system (verl, slime, an earlier run, ...) as a TRL ``rollout_func``.

The store is a table with one row per completion: the prompt (string or chat messages, exactly as the training
dataset holds it), the completion's token ids and the sampler's per-token log-probs; optionally the prompt's
token ids (otherwise the trainer's tokenizer/chat template encodes the prompt). Column names are configurable.

Matching rule: rows are grouped by prompt in file order. In each call, the k-th entry of a prompt (counting the
``num_generations`` repeats, across all processes in rank order) receives the k-th stored completion of that
prompt. Every call starts counting at 0 again, so a later epoch replays the same completions. Too few stored
completions for a prompt, or an unknown prompt, is an error naming the prompt. Chat prompts are compared as
JSON with ``None``-valued message fields dropped (``datasets`` adds them when it unifies message schemas).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .base import SamplerSource, trainer_prompt_ids
from .validation import RolloutValidationError, prompt_head, validate_rollout


def prompt_key(prompt: Any) -> str:
    """A canonical, hashable key of a prompt (string or list of message dicts)."""
    if isinstance(prompt, str):
        return "s:" + prompt

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if v is not None}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return "j:" + json.dumps(clean(prompt), sort_keys=True, ensure_ascii=False)


def load_rows(data: Any) -> list[dict]:
    """Rows of a ``datasets.Dataset``, a list of dicts, or a ``.jsonl``/``.json``/``.parquet`` path."""
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if not os.path.exists(path):
            raise FileNotFoundError(f"offline rollouts file not found: {path}")
        ext = os.path.splitext(path)[1].lower()
        if ext in (".jsonl", ".json"):
            with open(path, encoding="utf-8") as f:
                if ext == ".json":
                    rows = json.load(f)
                else:
                    rows = []
                    for n, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                rows.append(json.loads(line))
                            except ValueError as e:
                                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
        elif ext == ".parquet":
            import datasets

            rows = datasets.Dataset.from_parquet(path).to_list()
        else:
            raise ValueError(
                f"offline rollouts: unsupported file type {ext!r} (use .jsonl, .json or .parquet)"
            )
    elif hasattr(data, "to_list"):  # datasets.Dataset
        rows = data.to_list()
    else:
        rows = list(data)
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError("offline rollouts: every row must be a dict (one completion per row)")
    return rows


class OfflineRollouts(SamplerSource):
    """Serve stored completions and sampler log-probs for the prompts the trainer asks about.

    Args:
        data: ``datasets.Dataset``, list of dicts, or a ``.jsonl``/``.json``/``.parquet`` path.
        prompt_column, completion_column, logprobs_column: column names (defaults: ``prompt``,
            ``completion_ids``, ``sampler_logprobs``).
        prompt_ids_column: column with the prompt's token ids, used when present (default ``prompt_ids``);
            otherwise the trainer encodes the prompt like TRL does.
        forward_columns: extra columns returned per entry (TRL forwards them to the reward functions).
    """

    name = "offline"

    def __init__(
        self,
        data: Any,
        *,
        prompt_column: str = "prompt",
        completion_column: str = "completion_ids",
        logprobs_column: str = "sampler_logprobs",
        prompt_ids_column: str | None = "prompt_ids",
        forward_columns: Sequence[str] = (),
        validate: bool = True,
    ):
        super().__init__(params=None, weight_sync=None, validate=validate)
        rows = load_rows(data)
        if not rows:
            raise ValueError("offline rollouts: the store is empty")
        needed = [prompt_column, completion_column, logprobs_column, *forward_columns]
        for i, row in enumerate(rows):
            absent = [c for c in needed if c not in row]
            if absent:
                raise ValueError(f"offline rollouts row {i}: missing column(s) {absent} (has {sorted(row)})")
        self.columns = (prompt_column, completion_column, logprobs_column)
        self.forward_columns = tuple(forward_columns)
        self.has_prompt_ids = prompt_ids_column is not None and all(
            row.get(prompt_ids_column) is not None for row in rows
        )
        self.prompt_ids_column = prompt_ids_column
        self.rows = rows
        self.by_prompt: dict[str, list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            self.by_prompt[prompt_key(row[prompt_column])].append(i)
        if validate:  # catch a broken export at load time, naming the row (vocabulary checked per call)
            store = {
                "prompt_ids": [row[prompt_ids_column] if self.has_prompt_ids else [0] for row in rows],
                "completion_ids": [row[completion_column] for row in rows],
                "logprobs": [row[logprobs_column] for row in rows],
            }
            try:
                validate_rollout(store, None, prompts=[row[prompt_column] for row in rows])
            except RolloutValidationError as e:
                raise RolloutValidationError(f"offline rollouts store (sample = row index): {e}") from None

    def __len__(self) -> int:
        return len(self.rows)

    def _global_prompts(self, prompts: list, trainer: Any) -> tuple[list, int]:
        """All processes' prompt entries in rank order, and this process's offset in them."""
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is None or accelerator.num_processes == 1:
            return prompts, 0
        from accelerate.utils import gather_object

        sizes = gather_object([len(prompts)])
        everything = gather_object(list(prompts))
        return everything, sum(sizes[: accelerator.process_index])

    def select(self, prompts: Sequence[Any], offset: int = 0, count: int | None = None) -> list[int]:
        """Row index for entries ``offset .. offset+count`` of ``prompts`` (k-th repeat -> k-th stored row)."""
        count = len(prompts) - offset if count is None else count
        seen: dict[str, int] = defaultdict(int)
        chosen = []
        for j, prompt in enumerate(prompts[: offset + count]):
            key = prompt_key(prompt)
            k = seen[key]
            seen[key] += 1
            if j < offset:
                continue
            stored = self.by_prompt.get(key)
            if not stored:
                raise KeyError(f"offline rollouts: no stored completion for prompt {prompt_head(prompt)!r}")
            if k >= len(stored):
                raise ValueError(
                    f"offline rollouts: prompt {prompt_head(prompt)!r} is requested {k + 1}+ times in this "
                    f"generation batch but only {len(stored)} completion(s) are stored"
                )
            chosen.append(stored[k])
        return chosen

    def rollout(self, prompts: Sequence[Any], offset: int = 0, count: int | None = None) -> dict:
        """Stored completions for ``prompts[offset:offset+count]`` (no trainer needed, no prompt ids)."""
        _, completion_col, logprobs_col = self.columns
        rows = [self.rows[i] for i in self.select(prompts, offset, count)]
        out = {
            "completion_ids": [list(r[completion_col]) for r in rows],
            "logprobs": [[None if v is None else float(v) for v in r[logprobs_col]] for r in rows],
        }
        if self.has_prompt_ids:
            out["prompt_ids"] = [list(r[self.prompt_ids_column]) for r in rows]
        for c in self.forward_columns:
            out[c] = [r[c] for r in rows]
        return out

    def __call__(self, prompts: list, trainer: Any) -> dict:
        everything, offset = self._global_prompts(list(prompts), trainer)
        out = self.rollout(everything, offset, len(prompts))
        if "prompt_ids" not in out:
            out["prompt_ids"] = trainer_prompt_ids(prompts, trainer)
        ordered = {k: out[k] for k in ("prompt_ids", "completion_ids", "logprobs")}
        ordered.update({c: out[c] for c in self.forward_columns})
        return self.finish(ordered, prompts, trainer)
