"""validate_rollout: every rule has a test that breaks it and checks the error names sample, prompt, position."""

from __future__ import annotations

import math

import pytest

from triage.trainers.sampling import RolloutValidationError, validate_rollout

PROMPTS = ["What is 1 + 1?", [{"role": "user", "content": "Compute 7 * 8 - 3, please"}]]


def good():
    return {
        "prompt_ids": [[5, 6, 7], [8, 9]],
        "completion_ids": [[10, 11, 2], [12, 13, 14]],
        "logprobs": [[-0.5, -1.0, -0.1], [-2.0, -0.3, 0.0]],
    }


def check(out, match, **kw):
    kw.setdefault("eos_ids", [2])
    kw.setdefault("prompts", PROMPTS)
    with pytest.raises(RolloutValidationError, match=match) as e:
        validate_rollout(out, 100, **kw)
    return str(e.value)


def test_good_rollout_passes_and_extra_keys_are_ignored():
    out = good()
    out["my_extra"] = ["a", "b"]
    validate_rollout(out, 100, eos_ids=[2], prompts=PROMPTS)
    validate_rollout(good(), None)  # no vocabulary bound, no prompts


def test_rounding_above_zero_within_tolerance_is_accepted_beyond_is_not():
    out = good()
    out["logprobs"][0][0] = 5e-5
    validate_rollout(out, 100, prompts=PROMPTS)
    out["logprobs"][0][0] = 1e-3
    msg = check(out, "must be <= 0")
    assert "sample 0" in msg and "position 0" in msg


def test_missing_key_and_wrong_types():
    out = good()
    del out["logprobs"]
    check(out, r"no \['logprobs'\]")
    out = good()
    out["completion_ids"] = "oops"
    check(out, "must be a list of lists")
    with pytest.raises(RolloutValidationError, match="must be a dict"):
        validate_rollout([1, 2], 100)
    out = good()
    out["logprobs"][1] = 0.5
    check(out, "sample 1 .*must each be a list")


def test_count_rules():
    out = good()
    out["logprobs"].pop()
    check(out, "lists differ in length")
    out = good()
    check(out, "2 completions for 3 prompt entries", prompts=[*PROMPTS, "third"])


def test_length_mismatch_names_sample_and_prompt_head():
    out = good()
    out["logprobs"][1] = [-0.1, -0.2]
    msg = check(out, "3 completion tokens but 2 log-probs")
    assert "sample 1" in msg and "Compute 7 * 8 - 3" in msg


@pytest.mark.parametrize(
    "value, words",
    [
        (float("nan"), "returned NaN"),
        (None, "None \\(missing\\)"),
        (math.inf, "returned \\+inf"),
        (-math.inf, "returned -inf for a sampled token"),
        (-9999.0, "returned -inf for a sampled token"),  # vLLM's clamp of -inf
        (-1500.0, "returned -inf for a sampled token"),  # any sentinel at or below token_gap's -1000 rule
        (-3.4028234663852886e38, "returned -inf for a sampled token"),  # finfo(float32).min
        ("-0.5", "of type str: a log-prob must be a number"),
    ],
)
def test_bad_logprob_values(value, words):
    out = good()
    out["logprobs"][1][2] = value
    msg = check(out, words)
    assert "sample 1" in msg and "completion position 2" in msg


def test_token_ids_out_of_range_negative_or_not_int():
    for bad, pos in [(100, 1), (-1, 0), (3.0, 2), ("7", 0)]:
        out = good()
        out["completion_ids"][0][pos] = bad
        msg = check(out, "not in \\[0, 100\\)")
        assert f"sample 0 (prompt 'What is 1 + 1?'): completion position {pos}" in msg
    out = good()
    out["prompt_ids"][1][0] = 1000
    check(out, "sample 1 .*prompt position 0: token id 1000")


def test_empty_completion_is_rejected_not_dropped():
    out = good()
    out["completion_ids"][1], out["logprobs"][1] = [], []
    check(out, "sample 1 .*completion is empty")


def test_empty_prompt_is_rejected():
    out = good()
    out["prompt_ids"][0] = []
    check(out, "sample 0 .*prompt has no token")


def test_eos_only_at_the_end():
    out = good()
    out["completion_ids"][1] = [12, 2, 14]
    msg = check(out, "EOS id 2 before the last token")
    assert "sample 1" in msg and "position 1" in msg
    validate_rollout(out, 100, eos_ids=[], prompts=PROMPTS)  # without EOS ids, no EOS rule


def test_many_problems_are_summarised():
    n = 20
    out = {"prompt_ids": [[5]] * n, "completion_ids": [[7]] * n, "logprobs": [[float("nan")]] * n}
    msg = check(out, "and more; showing the first 3", prompts=None, max_reported=3)
    assert msg.count("returned NaN") == 3


def multiturn():
    """Two assistant turns: turn 1 ends with EOS (2), then environment tokens (an EOS inside them too, and a
    placeholder NaN log-prob), then turn 2 ending with EOS."""
    out = good()
    out["completion_ids"][0] = [10, 2, 30, 2, 31, 11, 2]
    out["logprobs"][0] = [-0.5, -0.1, math.nan, 0.0, 0.0, -1.0, -0.2]
    out["env_mask"] = [[1, 1, 0, 0, 0, 1, 1], [1, 1, 1]]
    return out


def test_env_mask_lets_an_eos_end_a_turn_and_skips_environment_logprobs():
    out = multiturn()
    validate_rollout(out, 100, eos_ids=[2], prompts=PROMPTS, env_mask=out["env_mask"])
    # without the mask the same completion breaks two rules
    check(out, "log-prob NaN")
    check(out, "EOS id 2 before the last token", env_mask=[[1] * 7, [1, 1, 1]])


def test_env_mask_still_checks_model_tokens():
    out = multiturn()
    out["logprobs"][0][5] = math.nan  # a model token of turn 2
    msg = check(out, "log-prob NaN", env_mask=out["env_mask"])
    assert "sample 0" in msg and "position 5" in msg
    out = multiturn()
    out["completion_ids"][0][5] = 2  # EOS inside a turn (followed by a model token)
    msg = check(out, "EOS id 2 before the last token", env_mask=out["env_mask"])
    assert "position 5" in msg


def test_env_mask_must_match_the_completion():
    out = multiturn()
    msg = check(out, "env_mask must hold one 0/1 per completion token", env_mask=[[1, 0], [1, 1, 1]])
    assert "sample 0" in msg
    check(out, "env_mask must hold", env_mask=[out["env_mask"][0], [1, 2, 1]])
