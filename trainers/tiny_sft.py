"""The synthetic arithmetic task and the small SFT loop that train the tiny models of this library.

One task generator, :func:`arithmetic_problem`, at six difficulty levels (1 = sums ≤ 20, … 6 = running sums
of 11–13 two-digit numbers with 135–175-token worked solutions), and one supervised loop, :func:`sft_steps`,
over a pre-tokenised tensor (:func:`pad_completions`). ``triage diagnose --model tiny`` trains on level 1
with the bare problem as the prompt; ``triage.experiments.sft`` wraps the same problems in the DAPO prompt
(``triage.experiments.data.synthetic_math``) and adds evaluation, a wall-clock cap and checkpoints.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_DIFFICULTY",
    "ArithmeticProblem",
    "arithmetic_problem",
    "pad_completions",
    "warmup_cosine",
    "sft_steps",
]

MAX_DIFFICULTY = 6


@dataclass(frozen=True)
class ArithmeticProblem:
    """One synthetic problem: its text, the worked-solution lines and the integer answer."""

    problem: str
    steps: tuple[str, ...]
    answer: int

    @property
    def solution(self) -> str:
        """The worked solution: the steps on one line, then ``Answer: N`` on its own line."""
        return " ".join(self.steps) + f"\nAnswer: {self.answer}"


def _signed(n: int) -> str:
    return f"({n})" if n < 0 else str(n)


def _times_x(a: int) -> str:
    return "x" if a == 1 else f"{a}x"


def _linear_lhs(a: int, b: int) -> str:
    return f"{_times_x(a)} + {b}" if b >= 0 else f"{_times_x(a)} - {-b}"


def _level_1(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.5:
        return f"Compute {a} + {b}.", [f"{a} + {b} = {a + b}."], a + b
    a, b = max(a, b), min(a, b)
    return f"Compute {a} - {b}.", [f"{a} - {b} = {a - b}."], a - b


def _level_2(rng: random.Random) -> tuple[str, list[str], int]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"Compute {a} * {b}.", [f"{a} * {b} = {a * b}."], a * b
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    value = a + b if op == "+" else a - b
    return f"Compute {a} {op} {b}.", [f"{a} {op} {b} = {value}."], value


def _level_3(rng: random.Random) -> tuple[str, list[str], int]:
    a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(2, 9)
    form = rng.randrange(3)
    if form == 0:  # (a + b) * c
        s = a + b
        return f"Compute ({a} + {b}) * {c}.", [f"{a} + {b} = {s}.", f"{s} * {c} = {s * c}."], s * c
    if form == 1:  # a + b * c
        p = b * c
        return f"Compute {a} + {b} * {c}.", [f"{b} * {c} = {p}.", f"{a} + {p} = {a + p}."], a + p
    p = c * b  # c * b - a
    return f"Compute {c} * {b} - {a}.", [f"{c} * {b} = {p}.", f"{p} - {a} = {p - a}."], p - a


def _level_4(rng: random.Random) -> tuple[str, list[str], int]:
    x, a, b = rng.randint(-12, 12), rng.randint(2, 9), rng.randint(-30, 30)
    c = a * x + b
    steps = [f"{a}x = {c} - {_signed(b)} = {c - b}.", f"x = {c - b} / {a} = {x}."]
    return f"Solve for x: {_linear_lhs(a, b)} = {c}.", steps, x


def _level_5(rng: random.Random) -> tuple[str, list[str], int]:
    x = rng.randint(-15, 15)
    a = rng.randint(3, 12)
    c = rng.randint(1, a - 1)  # a > c, so k = a - c > 0
    b = rng.randint(-40, 40)
    d = (a - c) * x + b  # so a x + b = c x + d
    k, m = a - c, d - b
    steps = [
        f"Subtract {_times_x(c)} from both sides: {_linear_lhs(k, b)} = {d}.",
        f"{_times_x(k)} = {d} - {_signed(b)} = {m}.",
        f"x = {m} / {k} = {x}.",
    ]
    return f"Solve for x: {_linear_lhs(a, b)} = {_linear_lhs(c, d)}.", steps, x


def _level_6(rng: random.Random) -> tuple[str, list[str], int]:
    """A running sum of 11–13 two-digit numbers, one line per partial sum: the worked solution is 135–175
    tokens with digit-level tokenisation (139–173 in 99.9 % of problems), so one slip anywhere in a long
    completion changes the answer."""
    terms = [rng.randint(10, 99) for _ in range(rng.randint(11, 13))]
    steps, total = [], terms[0]
    for t in terms[1:]:
        steps.append(f"{total} + {t} = {total + t}.")
        total += t
    return f"Compute {' + '.join(map(str, terms))}.", steps, total


_LEVELS: dict[int, Callable[[random.Random], tuple[str, list[str], int]]] = {
    1: _level_1,  # a + b, a - b with a, b <= 20
    2: _level_2,  # two-digit + and -, or a times table product
    3: _level_3,  # three operands with precedence / parentheses
    4: _level_4,  # one-sided linear equation a x + b = c, integer x
    5: _level_5,  # two-sided linear equation a x + b = c x + d, integer x
    6: _level_6,  # a running sum of 11-13 two-digit numbers (long worked solutions)
}


def arithmetic_problem(difficulty: int, seed: int, index: int, split: str = "train") -> ArithmeticProblem:
    """Problem ``index`` of the stream ``(seed, split, difficulty)``; a pure function of its arguments
    (``random.Random`` seeded with the string ``triage-synthetic/{seed}/{split}/{difficulty}/{index}``,
    which is hashed with SHA-512, not ``hash()``)."""
    if isinstance(difficulty, bool) or difficulty not in _LEVELS:
        raise ValueError(f"difficulty must be an int in 1..{MAX_DIFFICULTY}, got {difficulty!r}")
    rng = random.Random(f"triage-synthetic/{seed}/{split}/{difficulty}/{index}")
    problem, steps, answer = _LEVELS[difficulty](rng)
    return ArithmeticProblem(problem, tuple(steps), answer)


def pad_completions(rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int):
    """(input_ids, attention_mask, labels) tensors of ``(prompt ids, completion ids)`` rows, right-padded with
    ``pad_id``; labels are −100 on the prompt and the padding (the loss is on the completion only)."""
    import torch

    if not rows:
        raise ValueError("pad_completions: no rows")
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor([*p, *c])
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(list(c))
    return ids, mask, labels


def warmup_cosine(step: int, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate factor: linear warm-up ``(step+1)/warmup_steps`` over ``warmup_steps``, then cosine
    ``r + (1−r)·½(1 + cos π·p)`` from 1 to ``r = min_lr_ratio`` at ``steps`` (``p`` = progress after warm-up)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def sft_steps(
    model,
    ids,
    mask,
    labels,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    min_lr_ratio: float = 1.0,
    seed: int = 0,
) -> Iterator[tuple[int, object]]:
    """Train ``model`` on the rows of ``ids``/``mask``/``labels`` (:func:`pad_completions`, on the model's
    device); yield ``(step, loss)`` after each of the ``steps`` optimizer steps (1-based; stop early by leaving
    the loop). Each step draws ``batch_size`` rows with replacement (a ``seed``-ed CPU generator), trims the
    padding columns and minimises the completion cross-entropy ``L = −(1/|C|) Σ_{t∈C} log p_θ(x_t | x_<t)``
    with AdamW (β = (0.9, 0.98)), gradients clipped to norm 1 and the :func:`warmup_cosine` schedule; bf16
    autocast on CUDA. The model is left in train mode."""
    import torch

    device = ids.device
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.98)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, steps, warmup_steps, min_lr_ratio)
    )
    generator = torch.Generator(device="cpu").manual_seed(seed)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    model.train()
    for step in range(1, steps + 1):
        index = torch.randint(0, ids.size(0), (batch_size,), generator=generator).to(device)
        batch_mask = mask[index]
        width = int(batch_mask.sum(1).max())
        with autocast:
            out = model(
                input_ids=ids[index, :width],
                attention_mask=batch_mask[:, :width],
                labels=labels[index, :width],
            )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        yield step, out.loss.detach()
