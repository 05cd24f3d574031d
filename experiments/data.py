"""DAPO-format math data: DAPO-Math-17k, AIME-2024, local files and a synthetic generator, all as
``datasets.Dataset`` in one row schema (:data:`FEATURES`)::

    data_source   str                      "math_dapo" for real DAPO-format data, "synthetic_math" else
    prompt        [{"content", "role"}]    one user message: DAPO_PROMPT_PREFIX + problem + DAPO_PROMPT_SUFFIX
    ability       str                      "MATH"
    reward_model  {"ground_truth", "style"}  ground truth as an integer string ("25", "-3"); style
                                             "rule-lighteval/MATH_v2" (the ``math_dapo`` rule)
    extra_info    {"index", "raw_problem", "split", "difficulty", "solution"}
                  index: str id; raw_problem: the problem without the instruction; split; difficulty
                  (synthetic only, else None); solution: a worked solution ending in "Answer: N"
                  (synthetic only, usable for SFT; else None)

This is the verl RL-parquet schema DAPO ships, with ``extra_info`` widened to one struct for every source.
TRL passes ``reward_model`` (and the other columns) to reward functions, see ``triage.trainers.rewards``.

Hub loaders (:func:`load_dapo_math_17k`, :func:`load_aime_2024`) need a reachable hub or a populated
``datasets`` cache; everything else is offline. Bad rows raise ``ValueError`` naming the row.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
from datasets import Dataset, Features, List, Value

from triage.trainers.tiny_sft import MAX_DIFFICULTY, arithmetic_problem

__all__ = [
    "DAPO_PROMPT_PREFIX",
    "DAPO_PROMPT_SUFFIX",
    "DAPO_MATH_17K",
    "DAPO_MATH_17K_PROCESSED",
    "AIME_2024",
    "FEATURES",
    "dapo_prompt",
    "dapo_row",
    "to_dapo_schema",
    "dedup_by_prompt",
    "repeat_rows",
    "load_dapo_math_17k",
    "load_aime_2024",
    "load_local",
    "load_aime24",
    "synthetic_problem",
    "synthetic_math",
    "synthetic_train_eval",
    "DATA_SOURCES",
    "load_from_spec",
    "validate_spec",
]

# Exact DAPO instruction (verified byte-exact on the 960 rows of DAPO's eval/aime-2024.parquet).
DAPO_PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_STYLE = "rule-lighteval/MATH_v2"

DAPO_MATH_17K = "BytedTsinghua-SIA/DAPO-Math-17k"  # 1.79M rows = ~17.4k unique prompts repeated
DAPO_MATH_17K_PROCESSED = "open-r1/DAPO-Math-17k-Processed"  # deduplicated; configs all / en / cn
AIME_2024 = "BytedTsinghua-SIA/AIME-2024"  # 960 rows = 30 problems x 32 copies (avg@32)


FEATURES = Features(
    {
        "data_source": Value("string"),
        "prompt": List({"content": Value("string"), "role": Value("string")}),
        "ability": Value("string"),
        "reward_model": {"ground_truth": Value("string"), "style": Value("string")},
        "extra_info": {
            "index": Value("string"),
            "raw_problem": Value("string"),
            "split": Value("string"),
            "difficulty": Value("int32"),
            "solution": Value("string"),
        },
    }
)


def dapo_prompt(problem: str) -> str:
    """The DAPO user message for ``problem``: PREFIX + problem + SUFFIX (no system message)."""
    return DAPO_PROMPT_PREFIX + problem + DAPO_PROMPT_SUFFIX


def _raw_problem(content: str) -> str:
    if content.startswith(DAPO_PROMPT_PREFIX) and content.endswith(DAPO_PROMPT_SUFFIX):
        return content[len(DAPO_PROMPT_PREFIX) : len(content) - len(DAPO_PROMPT_SUFFIX)]
    return content


def _integer_string(value: Any, where: str) -> str:
    """Ground truth as a string; integers are written without padding ("025" -> "25")."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: ground truth must be a string or an int, got {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: empty ground truth")
        text = value.strip()
        if re.fullmatch(r"[+-]?[0-9]+", text):  # ASCII digits only ("²".isdigit() is True, int() refuses it)
            return str(int(text))
        return text
    raise ValueError(
        f"{where}: ground truth must be a string or an int, got {type(value).__name__} {value!r}"
    )


def dapo_row(
    problem: str,
    answer: str | int,
    *,
    index: str | int,
    data_source: str = "math_dapo",
    split: str | None = None,
    difficulty: int | None = None,
    solution: str | None = None,
) -> dict[str, Any]:
    """One row of the schema for a plain problem and its answer (integer answers are unpadded)."""
    where = f"row {index!r}"
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{where}: problem must be a non-empty string, got {problem!r}")
    return {
        "data_source": data_source,
        "prompt": [{"content": dapo_prompt(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": _integer_string(answer, where), "style": DAPO_STYLE},
        "extra_info": {
            "index": str(index),
            "raw_problem": problem,
            "split": split,
            "difficulty": difficulty,
            "solution": solution,
        },
    }


def _canonical_row(row: Mapping[str, Any], i: int, split: str | None) -> dict[str, Any]:
    """Map a row of any supported layout to the schema.

    Layouts: DAPO/verl (``prompt`` = messages, ``reward_model``), open-r1 processed (``prompt`` = user
    string, ``solution``), or plain (``problem`` + ``answer``, else ``solution``; ``answer`` wins when both
    exist, since plain files such as AIME keep a worked solution in ``solution``).
    """
    where = f"row {i}"
    prompt = row.get("prompt")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), Mapping) else {}
    reward_model = row.get("reward_model")
    if isinstance(reward_model, Mapping) and reward_model.get("ground_truth") is not None:
        truth = reward_model["ground_truth"]
        style = reward_model.get("style") or DAPO_STYLE
    elif row.get("answer") is not None:  # before `solution`: plain files (AIME) keep a worked solution there
        truth, style = row["answer"], DAPO_STYLE
    elif row.get("solution") is not None and not isinstance(row.get("solution"), Mapping):
        truth, style = row["solution"], DAPO_STYLE  # open-r1 processed: `solution` is the final answer
    else:
        raise ValueError(f"{where}: no ground truth (expected reward_model.ground_truth, answer or solution)")
    truth = _integer_string(truth, where)

    if isinstance(prompt, str):
        messages = [{"content": prompt, "role": "user"}]
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        messages = [{"content": m.get("content"), "role": m.get("role")} for m in prompt]
    elif prompt is None and isinstance(row.get("problem"), str):
        messages = [{"content": dapo_prompt(row["problem"]), "role": "user"}]
    else:
        raise ValueError(f"{where}: prompt must be a string or a non-empty list of messages, got {prompt!r}")
    for m in messages:
        if (
            not isinstance(m["content"], str)
            or not m["content"].strip()
            or m["role"]
            not in (
                "system",
                "user",
                "assistant",
            )
        ):
            raise ValueError(f"{where}: malformed prompt message {m!r}")
    if messages[-1]["role"] != "user":
        raise ValueError(
            f"{where}: the last prompt message must be the user's, got role {messages[-1]['role']!r}"
        )

    index = extra.get("index", row.get("id", i))
    return {
        "data_source": row.get("data_source") or "math_dapo",
        "prompt": messages,
        "ability": row.get("ability") or "MATH",
        "reward_model": {"ground_truth": truth, "style": style},
        "extra_info": {
            "index": str(index),
            "raw_problem": extra.get("raw_problem")
            or row.get("problem")
            or _raw_problem(messages[-1]["content"]),
            "split": extra.get("split") or split,
            "difficulty": extra.get("difficulty"),
            "solution": extra.get("solution"),
        },
    }


def to_dapo_schema(dataset, split: str | None = None, num_proc: int | None = None):
    """Convert a ``datasets.Dataset`` of a supported layout to the schema (all other columns dropped)."""
    return dataset.map(
        lambda row, i: _canonical_row(row, i, split),
        with_indices=True,
        remove_columns=dataset.column_names,
        features=FEATURES,
        num_proc=num_proc,
        desc="to DAPO schema",
    )


def _prompt_key(messages: Sequence[Mapping[str, str]]) -> str:
    text = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def dedup_by_prompt(dataset):
    """Keep the first row of each distinct prompt (DAPO-Math-17k repeats every prompt ~100 times).

    Warns (with the count) when copies of one prompt disagree on the ground truth; the first one is kept.
    """
    keys = dataset.map(
        lambda batch: {
            "_key": [_prompt_key(p) for p in batch["prompt"]],
            "_truth": [r["ground_truth"] for r in batch["reward_model"]],
        },
        batched=True,
        remove_columns=dataset.column_names,
        desc="hash prompts",
    )
    first: dict[str, tuple[int, str]] = {}
    conflicts = 0
    for i, (key, truth) in enumerate(zip(keys["_key"], keys["_truth"])):
        if key not in first:
            first[key] = (i, truth)
        elif first[key][1] != truth:
            conflicts += 1
    if conflicts:
        warnings.warn(
            f"dedup_by_prompt: {conflicts} duplicate rows disagree with the first copy's ground truth",
            stacklevel=2,
        )
    return dataset.select(sorted(i for i, _ in first.values()))


def repeat_rows(dataset, times: int):
    """Each row ``times`` times, copies adjacent (DAPO's avg@32 evaluation repeats AIME 32 times)."""
    if not isinstance(times, int) or times < 1:
        raise ValueError(f"times must be a positive int, got {times!r}")
    if times == 1:
        return dataset
    return dataset.select([i for i in range(len(dataset)) for _ in range(times)])


# ---------------------------------------------------------------------------------------------------------
# real data


def load_dapo_math_17k(
    variant: str = "processed", config: str = "all", split: str = "train", dedup: bool = True, **load_kwargs
):
    """DAPO-Math-17k from the hub, deduplicated by prompt, in the schema.

    ``variant="original"``: ``BytedTsinghua-SIA/DAPO-Math-17k`` (1.79M rows) deduplicated here;
    ``variant="processed"``: ``open-r1/DAPO-Math-17k-Processed`` (config ``all``, ``en`` or ``cn``).
    """
    if variant == "original":
        dataset = datasets.load_dataset(DAPO_MATH_17K, split=split, **load_kwargs)
    elif variant == "processed":
        if config not in ("all", "en", "cn"):
            raise ValueError(f"config must be 'all', 'en' or 'cn', got {config!r}")
        dataset = datasets.load_dataset(DAPO_MATH_17K_PROCESSED, config, split=split, **load_kwargs)
    else:
        raise ValueError(f"variant must be 'original' or 'processed', got {variant!r}")
    dataset = to_dapo_schema(dataset, split="train")
    return dedup_by_prompt(dataset) if dedup else dataset


def load_aime_2024(unique: bool = True, **load_kwargs):
    """``BytedTsinghua-SIA/AIME-2024`` (960 rows = 30 x 32) in the schema; ``unique`` keeps 30 rows
    (one per ``extra_info.index``); re-expand with :func:`repeat_rows` for avg@32."""
    dataset = to_dapo_schema(datasets.load_dataset(AIME_2024, split="train", **load_kwargs), split="test")
    return dedup_by_prompt(dataset) if unique else dataset


def load_local(path: str | os.PathLike, dedup: bool = False, split: str | None = None):
    """A local ``.parquet``, ``.jsonl``/``.json`` file (or a directory of them) in the schema.

    Accepted layouts: DAPO/verl, open-r1 processed, or plain ``problem`` + ``answer`` rows (the DAPO
    prompt is then built). No file found is an error.
    """
    path = Path(path)
    files = sorted(path.glob("*")) if path.is_dir() else [path]
    files = [f for f in files if f.suffix in (".parquet", ".jsonl", ".json")]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no .parquet/.jsonl/.json data at {path}")
    kinds = {"parquet" if f.suffix == ".parquet" else "json" for f in files}
    if len(kinds) != 1:
        raise ValueError(f"mixed parquet and json files under {path}")
    dataset = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")
    dataset = to_dapo_schema(dataset, split=split)
    return dedup_by_prompt(dataset) if dedup else dataset


def load_aime24(path: str | os.PathLike | None = None):
    """The 30 AIME-2024 problems in the schema, with the DAPO prompt and unpadded answers ("025" -> "25").

    ``path`` (or ``$TRIAGE_AIME24``): a local copy of Qwen2.5-Math's ``aime24/test.jsonl`` (MIT; not vendored),
    index = the file's ``id``. Neither given: the hub's ``BytedTsinghua-SIA/AIME-2024``, one row per problem
    (:func:`load_aime_2024`)."""
    if path is None:
        path = os.environ.get("TRIAGE_AIME24") or None
        if path is None:
            return load_aime_2024(unique=True)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"AIME-2024 file not found at {path} (TRIAGE_AIME24 or path=; neither: the hub copy)")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if "problem" not in item or "answer" not in item:
                raise ValueError(f"{path}:{line_no}: needs 'problem' and 'answer', has {sorted(item)}")
            rows.append(
                dapo_row(item["problem"], item["answer"], index=item.get("id", line_no), split="test")
            )
    return Dataset.from_list(rows, features=FEATURES)


# ---------------------------------------------------------------------------------------------------------
# synthetic problems

SYNTHETIC_SOURCE = "synthetic_math"


def synthetic_problem(difficulty: int, seed: int, index: int, split: str = "train") -> dict[str, Any]:
    """Problem ``index`` of the synthetic stream ``(seed, split, difficulty)`` as a DAPO row: the
    :func:`triage.trainers.tiny_sft.arithmetic_problem` of those arguments, its worked solution in
    ``extra_info.solution``."""
    p = arithmetic_problem(difficulty, seed, index, split)
    return dapo_row(
        p.problem,
        p.answer,
        index=f"synthetic-{split}-d{difficulty}-s{seed}-{index}",
        data_source=SYNTHETIC_SOURCE,
        split=split,
        difficulty=difficulty,
        solution=p.solution,
    )


def _difficulties(difficulty: int | Sequence[int]) -> list[int]:
    levels = [difficulty] if isinstance(difficulty, int) else list(difficulty)
    if not levels or any(isinstance(d, bool) or d not in range(1, MAX_DIFFICULTY + 1) for d in levels):
        raise ValueError(
            f"difficulty must be an int in 1..{MAX_DIFFICULTY} or a list of them, got {difficulty!r}"
        )
    return levels


def _synthetic_rows(
    n: int, difficulty: int | Sequence[int], seed: int, split: str, exclude: set[str] | None = None
) -> list[dict[str, Any]]:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    levels = _difficulties(difficulty)
    rows, index, misses = [], 0, 0
    while len(rows) < n:
        row = synthetic_problem(levels[index % len(levels)], seed, index, split)
        index += 1
        if exclude and row["extra_info"]["raw_problem"] in exclude:
            misses += 1
            if misses > 100 * (n + 1):
                raise ValueError(f"cannot draw {n} problems at difficulty {difficulty} outside `exclude`")
            continue
        rows.append(row)
    return rows


def synthetic_math(
    n: int,
    difficulty: int | Sequence[int] = 3,
    seed: int = 0,
    split: str = "train",
    held_out: int = 0,
):
    """``n`` synthetic DAPO-format problems with integer answers, deterministic in ``(seed, split)``.

    ``difficulty`` 1..6 (or a list cycled row by row): 1 = sums/differences <= 20, 2 = two-digit + - and
    times tables, 3 = three operands with precedence, 4 = ``a x + b = c``, 5 = ``a x + b = c x + d``,
    6 = a running sum of 11–13 two-digit numbers (135–175-token worked solutions).
    Each row carries a worked solution ending in ``Answer: N`` in ``extra_info.solution`` (for SFT).
    ``held_out`` > 0 skips every problem text that occurs in ``synthetic_math(held_out, difficulty, seed,
    split="eval")``, so that set is a held-out eval set for this one.
    """
    if not isinstance(held_out, int) or held_out < 0:
        raise ValueError(f"held_out must be a non-negative int, got {held_out!r}")
    exclude = None
    if held_out:
        exclude = {
            r["extra_info"]["raw_problem"] for r in _synthetic_rows(held_out, difficulty, seed, "eval")
        }
    return Dataset.from_list(_synthetic_rows(n, difficulty, seed, split, exclude), features=FEATURES)


def synthetic_train_eval(
    n_train: int, n_eval: int, difficulty: int | Sequence[int] = 3, seed: int = 0
) -> tuple[Any, Any]:
    """Train set and held-out eval set with no problem text in common (``held_out=n_eval``)."""
    return (
        synthetic_math(n_train, difficulty, seed, "train", held_out=n_eval),
        synthetic_math(n_eval, difficulty, seed, "eval"),
    )


# ---------------------------------------------------------------------------------------------------------
# recipe specs: {"source": NAME, **options, "limit": N, "repeat": K}

DATA_SOURCES: dict[str, Callable[..., Any]] = {
    "dapo-math-17k": load_dapo_math_17k,
    "aime-2024": load_aime_2024,
    "aime24": load_aime24,
    "local": load_local,
    "synthetic": synthetic_math,
}
"""Dataset ``source`` names a recipe may use, mapped to their loaders (options = the loader's arguments)."""

_COMMON_OPTIONS = ("limit", "repeat")


def validate_spec(spec: Mapping[str, Any]) -> None:
    """Check a dataset spec without loading anything: known ``source``, options the loader accepts."""
    if not isinstance(spec, Mapping) or "source" not in spec:
        raise ValueError(f"a dataset spec is a mapping with a 'source' key, got {spec!r}")
    source = spec["source"]
    if source not in DATA_SOURCES:
        raise ValueError(f"unknown dataset source {source!r}; known: {sorted(DATA_SOURCES)}")
    params = inspect.signature(DATA_SOURCES[source]).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    options = [k for k in spec if k != "source" and k not in _COMMON_OPTIONS]
    unknown = [k for k in options if k not in params]
    if unknown and not takes_kwargs:
        raise ValueError(f"dataset source {source!r} does not take {unknown}; it takes {sorted(params)}")
    required = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    missing = [name for name in required if name not in spec]
    if missing:
        raise ValueError(f"dataset source {source!r} needs {missing}")
    for key in _COMMON_OPTIONS:
        if key in spec and spec[key] is not None and (not isinstance(spec[key], int) or spec[key] < 1):
            raise ValueError(f"dataset option {key!r} must be a positive int, got {spec[key]!r}")
    if source == "synthetic" and "difficulty" in spec:
        _difficulties(spec["difficulty"])


def load_from_spec(spec: Mapping[str, Any]):
    """Load the dataset a recipe's ``dataset`` / ``eval_dataset`` section describes.

    >>> len(load_from_spec({"source": "synthetic", "n": 8, "difficulty": 2, "repeat": 2}))
    16
    """
    validate_spec(spec)
    options = {k: v for k, v in spec.items() if k != "source" and k not in _COMMON_OPTIONS}
    dataset = DATA_SOURCES[spec["source"]](**options)
    if spec.get("limit") is not None:
        dataset = dataset.select(range(min(spec["limit"], len(dataset))))
    if spec.get("repeat") is not None:
        dataset = repeat_rows(dataset, spec["repeat"])
    return dataset
