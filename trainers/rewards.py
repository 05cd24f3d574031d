"""Math rewards for GRPO on DAPO-style data: DAPO's ``math_dapo`` rule, a math-verify variant and the soft
overlong penalty, as plain functions and as TRL reward functions.

The DAPO rule (verl ``verl/utils/reward_score/math_dapo.py``, identical to ``BytedTsinghua-SIA/DAPO``
``eval/math_dapo.py``), reimplemented here with the same semantics:

1. keep the last 300 characters of the response;
2. take the **last** match of ``(?i)Answer\\s*:\\s*([^\\n]+)`` (``"[INVALID]"`` if there is none);
3. normalise prediction and ground truth with :func:`normalize_final_answer` (Minerva / hendrycks-math);
4. reward = +1 if the two normalised strings are equal, else −1 (exact string match, no sympy).

The soft overlong penalty is DAPO eq. 13, added to the ±1 correctness reward (TRL sums reward functions
before group normalisation, which is what verl's DAPO reward manager does)::

    R_len(y) = 0                              if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
             = -1                             if |y| > L_max

TRL reward functions receive ``(prompts, completions, completion_ids, **columns)``. The ground truth of
row i comes from the DAPO column ``reward_model[i]["ground_truth"]``, else ``solution[i]``, else
``answer[i]`` (in that order). A row without a usable ground truth is an error naming the row, never a
silent skip.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DAPO_ANSWER_PATTERN",
    "DAPO_TAIL_CHARS",
    "INVALID_ANSWER",
    "DapoScore",
    "normalize_final_answer",
    "extract_dapo_answer",
    "dapo_compute_score",
    "dapo_score",
    "math_verify_score",
    "completion_text",
    "ground_truths_from_columns",
    "DapoAccuracyReward",
    "MathVerifyAccuracyReward",
    "SoftOverlongPenalty",
    "dapo_accuracy_reward",
    "math_verify_accuracy_reward",
    "soft_overlong_penalty",
    "REWARD_FUNCTIONS",
    "build_reward_funcs",
]

DAPO_ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
DAPO_TAIL_CHARS = 300  # verl: "The longest answer in MATH-500 has 159 characters"
INVALID_ANSWER = "[INVALID]"

# Minerva normalisation tables, applied in this order (lm-eval hendrycks_math, as used by verl's math_dapo).
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Note: two entries contain a real newline ("\\text{\ns}", "\\text{\n}"); verl's list has the same quirk.
_REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_REGEX_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep what lies between the first pair of $...$
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
)


def normalize_final_answer(final_answer: str) -> str:
    """Minerva normalisation of a final answer, the steps in DAPO's order.

    1. keep the text after the last ``=``;  2. literal substitutions (articles, ``\\$``, *all* spaces, ...);
    3. delete unit / filler words (``degrees``, ``cm``, ``\\text{}``, ...);  4. keep the inside of the first
    ``$...$``, unwrap ``\\text{}``, ``\\textbf{}``, ``\\overline{}``, ``\\boxed{}``, expand ``\\fracab`` and
    ``\\sqrta``, drop ``$``;  5. drop thousands commas of a pure number (``3,400`` -> ``3400``), strip.

    Leading zeros and trailing dots are kept: ``034`` != ``34`` and ``34.`` != ``34`` (as in DAPO).
    """
    final_answer = final_answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expression in _REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expression, "")
    for pattern, replacement in _REGEX_REWRITES:
        final_answer = pattern.sub(replacement, final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def extract_dapo_answer(solution_str: str) -> str:
    """The raw text after the last ``Answer:`` in the last 300 characters, or ``"[INVALID]"``."""
    matches = DAPO_ANSWER_PATTERN.findall(solution_str[-DAPO_TAIL_CHARS:])
    return matches[-1] if matches else INVALID_ANSWER


@dataclass(frozen=True)
class DapoScore:
    """What DAPO's ``compute_score`` returns: the reward, whether it is correct, the normalised prediction."""

    score: float
    acc: bool
    pred: str


def _check_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}: {value!r}")
    return value


def _ground_truth_text(ground_truth: Any, what: str = "ground_truth") -> str:
    """Ground truths are strings; a Python int is accepted and written in base 10 (``34`` -> ``"34"``).

    Anything else (None, float, bool, ...) is an error: ``str(3.0)`` would silently never match ``3``.
    """
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int)):
        raise TypeError(
            f"{what} must be a str (or an int), got {type(ground_truth).__name__}: {ground_truth!r}"
        )
    return str(ground_truth)


def dapo_compute_score(solution_str: str, ground_truth: str | int) -> DapoScore:
    """DAPO's ``compute_score`` (default, non-strict-box path): ±1, accuracy and normalised prediction."""
    solution_str = _check_text(solution_str, "solution_str")
    truth = normalize_final_answer(_ground_truth_text(ground_truth))
    pred = normalize_final_answer(extract_dapo_answer(solution_str))
    correct = pred == truth
    return DapoScore(score=1.0 if correct else -1.0, acc=correct, pred=pred)


def dapo_score(solution_str: str, ground_truth: str | int) -> float:
    """+1.0 if the last ``Answer:`` line of the last 300 characters matches ``ground_truth`` after Minerva
    normalisation of both, else −1.0 (DAPO / verl ``math_dapo.compute_score(...)["score"]``)."""
    return dapo_compute_score(solution_str, ground_truth).score


# ---------------------------------------------------------------------------------------------------------
# math-verify variant


def _math_verify_timeouts() -> tuple[int | None, int | None]:
    # math_verify times out with signal.alarm, which only works in the main thread (as in trl.rewards).
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    return None, None


def math_verify_score(solution_str: str, ground_truth: str | int) -> float:
    """+1.0 if math-verify finds the response's answer equal to ``ground_truth``, else −1.0.

    The answer is the text after the last ``Answer:`` (DAPO's extraction, last 300 characters), parsed by
    math-verify as LaTeX or a plain expression; without an ``Answer:`` line, math-verify's own extraction
    (``\\boxed{}`` first) runs over the last 300 characters. So ``Answer: 0.5`` equals ``1/2`` and
    ``Answer: 034`` equals ``34``, which the exact-match DAPO rule rejects. Raises ``ValueError`` if the
    ground truth itself cannot be parsed (a data error, not a wrong answer).
    """
    from math_verify import parse, verify

    solution_str = _check_text(solution_str, "solution_str")
    truth = _ground_truth_text(ground_truth)
    parse_timeout, verify_timeout = _math_verify_timeouts()
    gold = parse(truth, parsing_timeout=parse_timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {truth!r}")
    tail = solution_str[-DAPO_TAIL_CHARS:]
    extracted = extract_dapo_answer(tail)
    if extracted != INVALID_ANSWER:
        text = extracted.strip()
        if "$" not in text and "\\(" not in text and "\\[" not in text:
            text = f"${text}$"  # a bare "Answer: \frac{1}{2}" line is LaTeX without delimiters
        answer = parse(text, parsing_timeout=parse_timeout)
    else:
        answer = parse(tail, parsing_timeout=parse_timeout)
    if not answer:
        return -1.0
    return 1.0 if verify(gold, answer, timeout_seconds=verify_timeout) else -1.0


# ---------------------------------------------------------------------------------------------------------
# TRL reward functions


def completion_text(completion: Any, index: int | None = None) -> str:
    """The response text of one TRL completion: a plain string, or a list of chat messages whose assistant
    contents are concatenated in order (TRL gives ``[{"role": "assistant", "content": text}]``). A tool-call
    message without content adds nothing; a list of content parts adds its ``text`` parts."""
    where = "" if index is None else f" (completion {index})"
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and all(isinstance(m, Mapping) for m in completion):
        parts = []
        for message in completion:
            if message.get("role", "assistant") != "assistant":
                continue
            content = message.get("content")
            if content is None and message.get("tool_calls"):  # a tool-call-only message: no answer text
                continue
            if isinstance(content, Sequence) and not isinstance(content, str):  # content parts
                content = "".join(
                    p.get("text") or ""
                    for p in content
                    if isinstance(p, Mapping) and p.get("type", "text") == "text"
                )
            if not isinstance(content, str):
                raise TypeError(f"assistant message content must be a str{where}, got {content!r}")
            parts.append(content)
        return "".join(parts)
    raise TypeError(f"a completion must be a str or a list of chat messages{where}, got {completion!r}")


def ground_truths_from_columns(n: int, columns: Mapping[str, Any]) -> list[str]:
    """Ground truth of each of ``n`` rows from the dataset columns TRL passes as keyword arguments.

    Looks for ``reward_model`` (DAPO: a dict with ``"ground_truth"`` per row), then ``answer``, then
    ``solution`` (``answer`` first: plain datasets such as AIME keep a worked solution in ``solution``). Raises ``ValueError`` naming the row when a value is missing, ``None`` or malformed.
    """
    for column in ("reward_model", "answer", "solution"):
        values = columns.get(column)
        if values is None:
            continue
        if len(values) != n:
            raise ValueError(f"column {column!r} has {len(values)} values for {n} completions")
        truths = []
        for i, value in enumerate(values):
            if column == "reward_model":
                if not isinstance(value, Mapping) or "ground_truth" not in value:
                    raise ValueError(
                        f"row {i}: reward_model must be a dict with 'ground_truth', got {value!r}"
                    )
                value = value["ground_truth"]
            try:
                truths.append(_ground_truth_text(value, f"row {i}: {column} ground truth"))
            except TypeError as err:
                raise ValueError(str(err)) from None
        return truths
    present = sorted(k for k in columns if not k.startswith(("log_", "trainer_")))
    raise ValueError(
        "no ground truth: expected a 'reward_model' (DAPO: {'ground_truth': ...}), 'answer' or 'solution' "
        f"dataset column; the reward function received {present}"
    )


class DapoAccuracyReward:
    """TRL reward function: DAPO's ±1 ``math_dapo`` score of each completion (see :func:`dapo_score`).

    Logs the normalised prediction as the ``dapo_pred`` column of TRL's completions table.
    """

    __name__ = "dapo_accuracy"

    def __call__(
        self, prompts=None, completions=None, log_extra: Callable | None = None, **columns
    ) -> list[float]:
        if completions is None:
            raise ValueError("dapo_accuracy needs `completions`")
        truths = ground_truths_from_columns(len(completions), columns)
        results = [
            dapo_compute_score(completion_text(c, i), truth)
            for i, (c, truth) in enumerate(zip(completions, truths))
        ]
        if log_extra is not None:
            log_extra("dapo_pred", [r.pred for r in results])
        return [r.score for r in results]


class MathVerifyAccuracyReward:
    """TRL reward function: ±1 by math-verify equivalence (see :func:`math_verify_score`)."""

    __name__ = "math_verify_accuracy"

    def __call__(self, prompts=None, completions=None, **columns) -> list[float]:
        if completions is None:
            raise ValueError("math_verify_accuracy needs `completions`")
        truths = ground_truths_from_columns(len(completions), columns)
        scores = []
        for i, (c, truth) in enumerate(zip(completions, truths)):
            try:
                scores.append(math_verify_score(completion_text(c, i), truth))
            except ValueError as err:
                raise ValueError(f"row {i}: {err}") from None
        return scores


class SoftOverlongPenalty:
    """TRL reward function: DAPO's soft overlong penalty (eq. 13) times ``penalty_factor``.

    ``|y|`` is the number of completion token ids TRL passes (EOS included when generated, as verl counts
    ``valid_response_length``). With ``penalty_factor = 1`` this is exactly
    ``trl.rewards.get_soft_overlong_punishment(max_completion_length, cache_length)``, which it calls.
    """

    __name__ = "soft_overlong_penalty"

    def __init__(self, max_completion_length: int, cache_length: int, penalty_factor: float = 1.0):
        if not isinstance(max_completion_length, int) or max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
        if not isinstance(cache_length, int) or not 0 < cache_length <= max_completion_length:
            raise ValueError(
                f"cache_length must be an int in (0, max_completion_length={max_completion_length}], "
                f"got {cache_length!r}"
            )
        if not penalty_factor >= 0:
            raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor!r}")
        from trl.rewards import get_soft_overlong_punishment

        self.max_completion_length = max_completion_length
        self.cache_length = cache_length
        self.penalty_factor = float(penalty_factor)
        self._penalty = get_soft_overlong_punishment(max_completion_length, cache_length)

    def __call__(self, completion_ids=None, **_) -> list[float]:
        if completion_ids is None:
            raise ValueError("soft_overlong_penalty needs `completion_ids` (TRL passes them)")
        return [self.penalty_factor * p for p in self._penalty(completion_ids=completion_ids)]

    def __repr__(self) -> str:
        return (
            f"SoftOverlongPenalty(max_completion_length={self.max_completion_length}, "
            f"cache_length={self.cache_length}, penalty_factor={self.penalty_factor})"
        )


dapo_accuracy_reward = DapoAccuracyReward()
math_verify_accuracy_reward = MathVerifyAccuracyReward()


def soft_overlong_penalty(
    max_completion_length: int, cache_length: int, penalty_factor: float = 1.0
) -> SoftOverlongPenalty:
    """Factory of the soft overlong penalty reward (DAPO recipe: L_max = 20480, cache 4096, factor 1)."""
    return SoftOverlongPenalty(max_completion_length, cache_length, penalty_factor)


# ---------------------------------------------------------------------------------------------------------
# names used in recipes (``reward_funcs: [dapo_accuracy, {soft_overlong: {cache_length: 4096}}]``)

DEFAULT_CACHE_FRACTION = 0.2  # DAPO: cache 4096 of L_max 20480


def _build_soft_overlong(max_completion_length: int | None, **kwargs) -> SoftOverlongPenalty:
    if max_completion_length is None:
        raise ValueError("reward 'soft_overlong' needs max_completion_length (the recipe's field)")
    kwargs.setdefault("cache_length", max(1, int(max_completion_length * DEFAULT_CACHE_FRACTION)))
    return SoftOverlongPenalty(max_completion_length, **kwargs)


def _no_options(name: str, instance: Callable) -> Callable[..., Callable]:
    def build(max_completion_length: int | None, **kwargs) -> Callable:
        if kwargs:
            raise ValueError(f"reward {name!r} takes no options, got {sorted(kwargs)}")
        return instance

    return build


REWARD_FUNCTIONS: dict[str, Callable[..., Callable]] = {
    "dapo_accuracy": _no_options("dapo_accuracy", dapo_accuracy_reward),
    "math_verify_accuracy": _no_options("math_verify_accuracy", math_verify_accuracy_reward),
    "soft_overlong": _build_soft_overlong,
}
"""Reward names a recipe may list, each mapped to a builder ``(max_completion_length, **options)``.
``soft_overlong`` options: ``cache_length`` (default 20% of max_completion_length), ``penalty_factor``."""


def _split_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping) and len(spec) == 1:
        ((name, options),) = spec.items()
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ValueError(f"options of reward {name!r} must be a mapping, got {options!r}")
        return name, dict(options)
    raise ValueError(f"a reward spec is a name or a one-key mapping {{name: {{options}}}}, got {spec!r}")


def build_reward_funcs(
    specs: Sequence[str | Mapping[str, Any]], max_completion_length: int | None = None
) -> list[Callable]:
    """TRL reward functions from recipe specs: names or one-key mappings ``{name: {option: value}}``.

    >>> [f.__name__ for f in build_reward_funcs(["dapo_accuracy", {"soft_overlong": {"cache_length": 64}}], 256)]
    ['dapo_accuracy', 'soft_overlong_penalty']
    """
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    funcs = []
    for spec in specs:
        name, options = _split_spec(spec)
        if name not in REWARD_FUNCTIONS:
            raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARD_FUNCTIONS)}")
        funcs.append(REWARD_FUNCTIONS[name](max_completion_length, **options))
    if not funcs:
        raise ValueError("reward_funcs is empty")
    return funcs
