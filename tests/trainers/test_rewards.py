"""DAPO reward (``math_dapo`` semantics), math-verify variant, soft overlong penalty, TRL reward functions.

Expected values in the tables were produced by verl's ``verl/utils/reward_score/math_dapo.py`` (HEAD
b178a3c) run on the same inputs.
"""

from __future__ import annotations

import pickle

import pytest
from trainer_testkit import make_trainer

from triage.trainers.rewards import (
    REWARD_FUNCTIONS,
    SoftOverlongPenalty,
    build_reward_funcs,
    completion_text,
    dapo_accuracy_reward,
    dapo_compute_score,
    dapo_score,
    extract_dapo_answer,
    ground_truths_from_columns,
    math_verify_accuracy_reward,
    math_verify_score,
    normalize_final_answer,
    soft_overlong_penalty,
)

# (model output, ground truth, DAPO score, normalised prediction) -- verl's outputs
DAPO_CASES = [
    ("Answer: 34", "34", 1.0, "34"),
    ("Answer: $34$", "34", 1.0, "34"),
    ("Answer: \\boxed{34}", "34", 1.0, "34"),
    ("Answer: 34 degrees", "34", 1.0, "34"),
    ("Answer: x = 34", "34", 1.0, "34"),
    ("answer:34", "34", 1.0, "34"),
    ("Answer: 34\nDone", "34", 1.0, "34"),
    ("Answer: 3,400", "3400", 1.0, "3400"),
    ("Answer: 34.", "34", -1.0, "34."),  # trailing dot kept
    ("Answer: 034", "34", -1.0, "034"),  # leading zero kept
    ("**Answer:** 34", "34", -1.0, "**34"),  # bold "Answer" fails
    ("The final answer is \\boxed{34}", "34", -1.0, "[INVALID]"),  # no Answer: line
    # trickier normalisation
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ("Answer: \\sqrt2", "\\sqrt{2}", 1.0, "\\sqrt{2}"),
    ("Answer: 5 \\text{ cm}", "5", 1.0, "5"),
    ("Answer: \\$5", "5", 1.0, "5"),
    ("Answer: 90^\\circ", "90", 1.0, "90"),
    ("Answer: $\\boxed{12}$.", "12", 1.0, "12"),
    ("Answer: 1,000,000", "1,000,000", 1.0, "1000000"),
    ("Answer: \\text{(B)}", "B", -1.0, "(B)"),
    ("Answer: 12 students", "12", 1.0, "12"),
    ("Answer: an 8", "8", 1.0, "8"),
    ("Answer: - 3", "-3", 1.0, "-3"),
    ("ANSWER :   7", "7", 1.0, "7"),
    ("Answer:\n7", "7", 1.0, "7"),  # \s* crosses the newline
    ("answer: 3\nAnswer: 4", "4", 1.0, "4"),  # the last match wins
    ("answer: 3\nAnswer: 4", "3", -1.0, "4"),
    ("Answer: 3 \\dots", "3", 1.0, "3"),
    ("Answer: 34.0", "34", -1.0, "34.0"),  # no numeric comparison
    ("Answer: 2^{10}", "1024", -1.0, "2^{10}"),
    ("Answer: x=5, y=6", "6", 1.0, "6"),  # text after the last "="
    ("Answer: \\overline{7}", "7", 1.0, "7"),
    ("Answer: \\textbf{9}", "9", 1.0, "9"),
    ("Answer: 7}", "7", -1.0, "7}"),
    ("The answer: 3 + 4 = 7", "7", 1.0, "7"),
]


@pytest.mark.parametrize(("output", "truth", "score", "pred"), DAPO_CASES)
def test_dapo_score_matches_verl(output, truth, score, pred):
    result = dapo_compute_score(output, truth)
    assert (result.score, result.pred, result.acc) == (score, pred, score > 0)
    assert dapo_score(output, truth) == score


def test_normalize_final_answer_steps():
    assert normalize_final_answer(" x = 1,234 ") == "1234"
    assert normalize_final_answer("1,23,4") == "1234"  # any commas of a pure digit string go
    assert normalize_final_answer("1,2a") == "1,2a"
    assert normalize_final_answer("$a$ and $b$") == "a"  # the first $...$ pair only
    assert normalize_final_answer("\\fracab") == "\\frac{a}{b}"
    assert normalize_final_answer("\\text{\ns}") == ""  # verl's removal list has a literal newline


def test_only_last_300_characters_count():
    answer = "Answer: 42\n"  # 11 characters
    assert dapo_score("x" * 1000 + answer, "42") == 1.0
    assert dapo_score(answer + "y" * 289, "42") == 1.0  # 300 characters: all in the tail
    assert dapo_score(answer + "y" * 290, "42") == -1.0  # the tail starts at "nswer: 42"
    assert extract_dapo_answer(answer + "y" * 290) == "[INVALID]"
    assert extract_dapo_answer("Answer: 1\n" + "x" * 280 + "Answer: 2") == "2"


def test_ground_truth_types():
    assert dapo_score("Answer: 34", 34) == 1.0  # an int is written in base 10
    assert dapo_score("Answer: -3", -3) == 1.0
    for bad in (None, 3.0, True, ["3"]):
        with pytest.raises(TypeError, match="ground_truth"):
            dapo_score("Answer: 3", bad)
    with pytest.raises(TypeError, match="solution_str"):
        dapo_score(None, "3")


def test_aime_ground_truth_as_model_answer(aime24_rows):
    assert len(aime24_rows) == 30
    padded = 0
    for row in aime24_rows:
        truth = str(int(row["answer"]))  # the README: unpad "025" -> "25"
        good = f"Let me think.\n{row['problem'][:200]}\nSo the result is {truth}.\nAnswer: {truth}"
        wrong = f"Let me think.\nAnswer: {int(truth) + 1}"
        assert dapo_score(good, truth) == 1.0, row["id"]
        assert dapo_score(wrong, truth) == -1.0, row["id"]
        assert dapo_score(f"Answer: \\boxed{{{truth}}}", truth) == 1.0
        assert dapo_score(row["solution"], truth) == -1.0  # human solutions have no "Answer:" line
        if row["answer"] != truth:  # zero-padded ground truths never match an unpadded answer
            padded += 1
            assert dapo_score(good, row["answer"]) == -1.0
    assert padded > 0


def test_math_verify_variant_on_aime(aime24_rows):
    for row in aime24_rows:
        truth = str(int(row["answer"]))
        assert math_verify_score(f"work\nAnswer: {truth}", truth) == 1.0
        assert math_verify_score(f"work\nAnswer: {row['answer']}", truth) == 1.0  # 025 == 25 here
        assert math_verify_score(f"work\nAnswer: {int(truth) + 1}", truth) == -1.0
        assert math_verify_score(f"so the answer is $\\boxed{{{truth}}}$", truth) == 1.0


def test_math_verify_variant_cases():
    assert math_verify_score("Answer: \\frac{1}{2}", "0.5") == 1.0
    assert math_verify_score("Answer: 2^{10}", "1024") == 1.0  # DAPO's exact match rejects this
    assert dapo_score("Answer: 2^{10}", "1024") == -1.0
    assert math_verify_score("no answer at all", "3") == -1.0
    assert math_verify_score("Answer: 3\n" + "y" * 300, "3") == -1.0  # same 300-character tail
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        math_verify_score("Answer: 3", "")


def test_completion_text_forms():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "a"}]) == "a"
    convo = [
        {"role": "assistant", "content": "call"},
        {"role": "tool", "content": "Answer: 1"},
        {"role": "assistant", "content": "Answer: 2"},
    ]
    assert completion_text(convo) == "callAnswer: 2"  # tool output is not the model's answer
    with pytest.raises(TypeError, match="completion 3"):
        completion_text(12, index=3)
    with pytest.raises(TypeError, match="content"):
        completion_text([{"role": "assistant", "content": None}])  # no text and no tool call: broken output
    tool_call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "calc"}}]}
    parts = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Answer: "}, {"type": "text", "text": "3"}],
    }
    assert completion_text([tool_call, {"role": "tool", "content": "3"}, parts]) == "Answer: 3"


def test_trl_reward_dapo_column_conversational_and_plain():
    reward_model = [{"ground_truth": "34", "style": "rule-lighteval/MATH_v2"}] * 2
    logged = {}
    scores = dapo_accuracy_reward(
        prompts=[[{"role": "user", "content": "q"}]] * 2,
        completions=[
            [{"role": "assistant", "content": "Answer: 34"}],
            [{"role": "assistant", "content": "34"}],
        ],
        completion_ids=[[1], [2]],
        reward_model=reward_model,
        data_source=["math_dapo"] * 2,
        log_extra=lambda name, values: logged.update({name: values}),
        trainer_state=None,
    )
    assert scores == [1.0, -1.0]
    assert logged == {"dapo_pred": ["34", "[INVALID]"]}
    plain = dapo_accuracy_reward(
        prompts=["q", "q"], completions=["Answer: 7", "Answer: 8"], solution=["7", "7"]
    )
    assert plain == [1.0, -1.0]
    assert dapo_accuracy_reward(completions=["Answer: 7"], answer=[7]) == [1.0]


def test_answer_column_wins_over_a_worked_solution(aime24_rows):
    """A plain dataset with both columns (AIME: `solution` is the worked text): `answer` is the ground truth."""
    row = aime24_rows[0]
    truth = str(int(row["answer"]))
    scores = dapo_accuracy_reward(
        completions=[f"... Answer: {truth}"], solution=[row["solution"]], answer=[row["answer"]]
    )
    assert scores == [1.0]


def test_trl_reward_bad_ground_truth_names_the_row():
    with pytest.raises(ValueError, match="row 1: reward_model"):
        dapo_accuracy_reward(completions=["a", "b"], reward_model=[{"ground_truth": "1"}, {"answer": "2"}])
    with pytest.raises(ValueError, match="row 0: solution"):
        dapo_accuracy_reward(completions=["a"], solution=[None])
    with pytest.raises(ValueError, match="no ground truth.*data_source"):
        dapo_accuracy_reward(completions=["a"], data_source=["x"])
    with pytest.raises(ValueError, match="2 values for 1 completions"):
        ground_truths_from_columns(1, {"answer": ["1", "2"]})


def test_trl_math_verify_reward():
    scores = math_verify_accuracy_reward(
        completions=[
            [{"role": "assistant", "content": "Answer: 0.5"}],
            [{"role": "assistant", "content": "1"}],
        ],
        reward_model=[{"ground_truth": "\\frac{1}{2}", "style": "x"}, {"ground_truth": "2", "style": "x"}],
    )
    assert scores == [1.0, -1.0]


def test_soft_overlong_matches_trl_and_dapo_eq13():
    from trl.rewards import get_soft_overlong_punishment

    penalty = soft_overlong_penalty(max_completion_length=20, cache_length=8)
    reference = get_soft_overlong_punishment(20, 8)
    ids = [[0] * n for n in range(0, 26)]
    assert penalty(completion_ids=ids) == reference(completion_ids=ids)
    values = penalty(completion_ids=ids)
    assert values[12] == 0.0 and values[13] == pytest.approx(-1 / 8) and values[20] == pytest.approx(-1.0)
    assert values[21] == -1.0
    half = SoftOverlongPenalty(20, 8, penalty_factor=0.5)
    assert half(completion_ids=ids) == [0.5 * v for v in values]
    assert penalty.__name__ == "soft_overlong_penalty"
    assert pickle.loads(pickle.dumps(penalty))(completion_ids=ids) == values  # TRL's async path pickles


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 0), "max_completion_length"),
        ((10, 0), "cache_length"),
        ((10, 11), "cache_length"),
        ((10, 4, -1.0), "factor"),
    ],
)
def test_soft_overlong_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        SoftOverlongPenalty(*args)


def test_reward_funcs_pickle_and_names():
    for func in (dapo_accuracy_reward, math_verify_accuracy_reward):
        clone = pickle.loads(pickle.dumps(func))
        assert clone.__name__ == func.__name__
        assert clone(completions=["Answer: 3"], answer=["3"]) == [1.0]


def test_build_reward_funcs():
    funcs = build_reward_funcs(
        ["dapo_accuracy", {"soft_overlong": {"cache_length": 64}}], max_completion_length=256
    )
    assert [f.__name__ for f in funcs] == ["dapo_accuracy", "soft_overlong_penalty"]
    assert funcs[1].cache_length == 64 and funcs[1].max_completion_length == 256
    (default,) = build_reward_funcs(["soft_overlong"], max_completion_length=20480)
    assert default.cache_length == 4096  # DAPO's 4096 of 20480
    assert set(REWARD_FUNCTIONS) == {"dapo_accuracy", "math_verify_accuracy", "soft_overlong"}
    with pytest.raises(ValueError, match="unknown reward 'accuracy'"):
        build_reward_funcs(["accuracy"])
    with pytest.raises(ValueError, match="needs max_completion_length"):
        build_reward_funcs(["soft_overlong"])
    with pytest.raises(ValueError, match="takes no options"):
        build_reward_funcs([{"dapo_accuracy": {"x": 1}}])
    with pytest.raises(ValueError, match="one-key mapping"):
        build_reward_funcs([{"dapo_accuracy": None, "soft_overlong": None}])
    with pytest.raises(ValueError, match="empty"):
        build_reward_funcs([])


def test_rewards_inside_trl_grpo_trainer(tmp_path):
    """One real TRL GRPO step on a tiny model and synthetic DAPO rows: TRL hands the reward functions the
    ``reward_model`` dicts and chat completions, and logs them under their names."""
    from trl import GRPOConfig, GRPOTrainer

    from triage.experiments.data import synthetic_math
    from triage.trainers.tiny import TinyModelSpec, build_model, build_tokenizer

    tokenizer = build_tokenizer()
    seen = {}

    def spy(prompts, completions, reward_model, **kwargs):
        seen.update(completion=completions[0], reward_model=reward_model[0])
        return [0.0] * len(prompts)

    trainer = make_trainer(
        build_model(tokenizer, TinyModelSpec()),
        tmp_path,
        rollout=None,
        dataset=synthetic_math(4, difficulty=1),
        reward=[*build_reward_funcs(["dapo_accuracy", {"soft_overlong": {"cache_length": 4}}], 16), spy],
        trainer_cls=GRPOTrainer,
        config_cls=GRPOConfig,
        trainer_kwargs={"processing_class": tokenizer},
        num_generations=4,
        max_completion_length=16,
        max_steps=1,
    )
    trainer.train()
    assert seen["completion"][0]["role"] == "assistant" and isinstance(seen["completion"][0]["content"], str)
    assert set(seen["reward_model"]) == {"ground_truth", "style"}
    (logs,) = [entry for entry in trainer.state.log_history if "rewards/dapo_accuracy/mean" in entry]
    assert -1.0 <= logs["rewards/dapo_accuracy/mean"] <= 1.0
    assert -1.0 <= logs["rewards/soft_overlong_penalty/mean"] <= 0.0
