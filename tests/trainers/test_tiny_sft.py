"""The shared tiny-model SFT pieces: the arithmetic generator's errors, the padding, the schedule, the loop."""

from __future__ import annotations

import pytest
import torch

from triage.trainers.tiny_sft import arithmetic_problem, pad_completions, sft_steps, warmup_cosine


def test_schedule_warms_up_then_decays_to_the_floor():
    factors = [warmup_cosine(s, steps=100, warmup_steps=10, min_lr_ratio=0.1) for s in range(101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


@pytest.mark.parametrize("bad", [0, 7, True, "1"])
def test_unknown_difficulty_is_an_error(bad):
    with pytest.raises(ValueError, match=r"difficulty must be an int in 1\.\.6"):
        arithmetic_problem(bad, 0, 0)


def test_solution_ends_in_the_answer_line():
    p = arithmetic_problem(3, seed=0, index=0)
    assert p.solution.endswith(f"\nAnswer: {p.answer}") and p.solution.startswith(p.steps[0])


def test_pad_completions_labels_the_completion_only():
    ids, mask, labels = pad_completions([([1, 2], [3]), ([4], [5, 6, 7])], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert labels.tolist() == [[-100, -100, 3, -100], [-100, 5, 6, 7]]
    with pytest.raises(ValueError, match="no rows"):
        pad_completions([], pad_id=0)


def test_sft_steps_lowers_the_loss_and_stops_when_the_caller_leaves():
    from triage.trainers.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    ids, mask, labels = pad_completions([([1, 2, 3], [4, 5, 6, 7])] * 2, tokenizer.pad_token_id)
    losses = []
    for step, loss in sft_steps(model, ids, mask, labels, steps=30, batch_size=2, learning_rate=1e-2):
        losses.append(float(loss))
        if step == 20:
            break
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0] and model.training
    assert torch.isfinite(torch.tensor(losses)).all()
