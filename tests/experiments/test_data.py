"""DAPO-format loaders: schema, exact prompt, dedup, local files, AIME, synthetic generator, specs.

No network: the hub loaders run with ``datasets.load_dataset`` replaced by an in-memory fake that returns
rows in the layouts of the hub datasets (``data.DAPO_MATH_17K``, ``data.DAPO_MATH_17K_PROCESSED``,
``data.AIME_2024``).
"""

from __future__ import annotations

import json
import re

import datasets
import pytest

from triage.experiments import data
from triage.experiments.data import (
    DAPO_PROMPT_PREFIX,
    DAPO_PROMPT_SUFFIX,
    FEATURES,
    dapo_prompt,
    dedup_by_prompt,
    load_aime24,
    load_from_spec,
    load_local,
    repeat_rows,
    synthetic_math,
    synthetic_problem,
    synthetic_train_eval,
    to_dapo_schema,
    validate_spec,
)
from triage.trainers.rewards import dapo_score

EXACT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
EXACT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def _original_row(problem: str, truth: str, uid: str) -> dict:
    """A row as BytedTsinghua-SIA/DAPO-Math-17k stores it."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": EXACT_PREFIX + problem + EXACT_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": uid},
    }


def _processed_row(problem: str, truth: str, uid: str) -> dict:
    """A row as open-r1/DAPO-Math-17k-Processed stores it (prompt is the user string)."""
    row = _original_row(problem, truth, uid)
    return {"prompt": row["prompt"][0]["content"], "solution": truth, "source_prompt": row["prompt"], **{
        k: row[k] for k in ("data_source", "ability", "reward_model", "extra_info")
    }}  # fmt: skip


def test_exact_dapo_prompt_text():
    assert DAPO_PROMPT_PREFIX == EXACT_PREFIX and DAPO_PROMPT_SUFFIX == EXACT_SUFFIX
    assert dapo_prompt("What is 1+1?") == EXACT_PREFIX + "What is 1+1?" + EXACT_SUFFIX


def _check_schema(ds):
    assert ds.features == FEATURES
    for i, row in enumerate(ds):
        (message,) = row["prompt"]
        assert message["role"] == "user"
        assert message["content"].startswith(EXACT_PREFIX) and message["content"].endswith(EXACT_SUFFIX), i
        assert message["content"] == dapo_prompt(row["extra_info"]["raw_problem"])
        assert row["ability"] == "MATH" and row["reward_model"]["style"] == "rule-lighteval/MATH_v2"
        assert row["reward_model"]["ground_truth"].lstrip("-").isdigit(), row


def test_hub_loaders_without_network(monkeypatch):
    original = [_original_row(f"P{i % 3}", str(i % 3), f"u{i}") for i in range(9)]  # 3 prompts, 3 copies each
    processed = [_processed_row(f"P{i}", str(10 + i), f"v{i}") for i in range(4)]
    aime = [_original_row(f"A{i % 2}", "073" if i % 2 else "25", str(i % 2)) for i in range(6)]
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        rows = {data.DAPO_MATH_17K: original, data.DAPO_MATH_17K_PROCESSED: processed, data.AIME_2024: aime}[
            path
        ]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = data.load_dapo_math_17k(variant="original")
    _check_schema(ds)
    assert [r["extra_info"]["raw_problem"] for r in ds] == ["P0", "P1", "P2"]  # first copy kept, order kept
    assert [r["extra_info"]["index"] for r in ds] == ["u0", "u1", "u2"]
    assert len(data.load_dapo_math_17k(variant="original", dedup=False)) == 9
    ds = data.load_dapo_math_17k(variant="processed", config="en")
    _check_schema(ds)
    assert [r["reward_model"]["ground_truth"] for r in ds] == ["10", "11", "12", "13"]
    ds = data.load_aime_2024()
    assert [r["reward_model"]["ground_truth"] for r in ds] == ["25", "73"]  # unpadded
    assert len(data.load_aime_2024(unique=False)) == 6
    assert (data.DAPO_MATH_17K, None, "train") in calls
    assert (data.DAPO_MATH_17K_PROCESSED, "en", "train") in calls
    with pytest.raises(ValueError, match="variant"):
        data.load_dapo_math_17k(variant="nope")
    with pytest.raises(ValueError, match="config"):
        data.load_dapo_math_17k(config="fr")


def test_dedup_warns_on_conflicting_ground_truths():
    ds = to_dapo_schema(
        datasets.Dataset.from_list([_original_row("P", "1", "a"), _original_row("P", "2", "b")])
    )
    with pytest.warns(UserWarning, match="1 duplicate rows disagree"):
        out = dedup_by_prompt(ds)
    assert [r["reward_model"]["ground_truth"] for r in out] == ["1"]


def test_local_files_parquet_jsonl_and_plain(tmp_path):
    rows = [_original_row(f"Q{i}", str(i), f"id{i}") for i in range(5)] + [_original_row("Q0", "0", "dup")]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    ds = load_local(tmp_path / "train.parquet", dedup=True)
    _check_schema(ds)
    assert len(ds) == 5
    processed = tmp_path / "processed.jsonl"
    processed.write_text("\n".join(json.dumps(_processed_row("R", "-4", "x")) for _ in range(2)))
    assert load_local(processed)[0]["reward_model"]["ground_truth"] == "-4"
    plain = tmp_path / "plain" / "a.jsonl"
    plain.parent.mkdir()
    plain.write_text(json.dumps({"problem": "Compute 2+2.", "answer": "004"}) + "\n")
    ds = load_local(plain.parent, split="test")
    _check_schema(ds)
    assert ds[0]["reward_model"]["ground_truth"] == "4" and ds[0]["extra_info"]["split"] == "test"
    # AIME's layout: `answer` is the ground truth, `solution` a worked solution
    plain.write_text(json.dumps({"problem": "Compute 2+2.", "solution": "2+2 is 4.", "answer": "4"}) + "\n")
    assert load_local(plain.parent)[0]["reward_model"]["ground_truth"] == "4"
    with pytest.raises(FileNotFoundError):
        load_local(tmp_path / "missing.parquet")


def test_bad_rows_name_the_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [_original_row("Q", "1", "a"), {**_original_row("Q2", "2", "b"), "reward_model": {"style": "x"}}]
    bad.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match="row 1: no ground truth"):
        load_local(bad)
    with pytest.raises(ValueError, match="row 0: empty ground truth"):
        to_dapo_schema(datasets.Dataset.from_list([{"problem": "p", "answer": " "}]))
    with pytest.raises(ValueError, match="row 0: the last prompt message must be the user's"):
        to_dapo_schema(
            datasets.Dataset.from_list([{"prompt": [{"role": "assistant", "content": "x"}], "answer": "1"}])
        )


def test_aime24_shared_file(aime24_path, aime24_rows):
    ds = load_aime24(aime24_path)
    _check_schema(ds)
    assert len(ds) == 30
    for row, raw in zip(ds, aime24_rows):
        assert row["extra_info"]["raw_problem"] == raw["problem"]
        assert row["extra_info"]["index"] == str(raw["id"])
        truth = row["reward_model"]["ground_truth"]
        assert truth == str(int(raw["answer"]))
        assert dapo_score(f"...\nAnswer: {truth}", truth) == 1.0
    assert load_from_spec({"source": "aime24", "path": str(aime24_path), "repeat": 32}).num_rows == 960
    with pytest.raises(FileNotFoundError, match="TRIAGE_AIME24"):
        load_aime24(aime24_path.parent / "nope.jsonl")


def test_synthetic_is_deterministic_and_correct():
    a = synthetic_math(200, difficulty=[1, 2, 3, 4, 5], seed=7)
    b = synthetic_math(200, difficulty=[1, 2, 3, 4, 5], seed=7)
    assert a.to_list() == b.to_list()
    assert (
        synthetic_math(50, difficulty=[1, 2, 3, 4, 5], seed=7).to_list() == a.to_list()[:50]
    )  # prefix-stable
    assert synthetic_math(200, difficulty=[1, 2, 3, 4, 5], seed=8).to_list() != a.to_list()
    _check_schema(a)
    for row in a:
        info = row["extra_info"]
        truth = row["reward_model"]["ground_truth"]
        assert info["solution"].endswith(f"\nAnswer: {truth}")
        assert dapo_score(info["solution"], truth) == 1.0  # worked solutions score +1 under the DAPO rule
        assert row["data_source"] == "synthetic_math" and 1 <= info["difficulty"] <= 5


def _evaluate(problem: str) -> int:
    """Independent check of a synthetic answer: evaluate the expression or solve the linear equation."""
    body = problem.rstrip(".")
    if body.startswith("Compute "):
        return eval(body[len("Compute ") :], {"__builtins__": {}})  # digits and + - * ( ) only
    lhs, rhs = body[len("Solve for x: ") :].split(" = ")

    def affine(side: str) -> tuple[int, int]:  # side = k x + c -> (k, c), from x = 0 and x = 1
        expr = re.sub(r"(\d)x", r"\1*x", side)
        at = [eval(expr, {"__builtins__": {}}, {"x": x}) for x in (0, 1)]
        return at[1] - at[0], at[0]

    (k1, c1), (k2, c2) = affine(lhs), affine(rhs)
    x, remainder = divmod(c2 - c1, k1 - k2)
    assert remainder == 0, problem
    return x


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_synthetic_answers_are_right(difficulty):
    for i in range(300):
        row = synthetic_problem(difficulty, seed=3, index=i)
        assert _evaluate(row["extra_info"]["raw_problem"]) == int(row["reward_model"]["ground_truth"])


def test_synthetic_difficulty_knob_and_held_out():
    def mean_answer_magnitude(level):
        ds = synthetic_math(300, difficulty=level, seed=0)
        return sum(abs(int(r["reward_model"]["ground_truth"])) for r in ds) / len(ds)

    assert mean_answer_magnitude(1) < mean_answer_magnitude(3)
    assert {synthetic_problem(4, 0, i)["extra_info"]["raw_problem"][:12] for i in range(5)} == {
        "Solve for x:"
    }
    train, held = synthetic_train_eval(2000, 300, difficulty=[1, 2], seed=0)
    train_problems = {r["extra_info"]["raw_problem"] for r in train}
    assert not train_problems & {r["extra_info"]["raw_problem"] for r in held}
    assert len(train) == 2000 and len(held) == 300
    for bad in (0, 7, [1, 9], [], True):
        with pytest.raises(ValueError, match="difficulty"):
            synthetic_math(2, difficulty=bad)


def test_specs_and_repeat():
    ds = load_from_spec({"source": "synthetic", "n": 10, "difficulty": 2, "seed": 1, "limit": 4, "repeat": 3})
    assert len(ds) == 12
    assert ds[0]["prompt"] == ds[2]["prompt"] != ds[3]["prompt"]  # copies adjacent
    validate_spec({"source": "dapo-math-17k", "variant": "original"})
    validate_spec({"source": "local", "path": "x.parquet"})
    with pytest.raises(ValueError, match="unknown dataset source"):
        validate_spec({"source": "gsm8k"})
    with pytest.raises(ValueError, match="does not take"):
        validate_spec({"source": "synthetic", "n": 3, "difficuly": 2})
    with pytest.raises(ValueError, match="needs \\['path'\\]"):
        validate_spec({"source": "local"})
    with pytest.raises(ValueError, match="positive int"):
        validate_spec({"source": "synthetic", "n": 3, "repeat": 0})
    with pytest.raises(ValueError, match="positive int"):
        repeat_rows(ds, 0)


def test_aime24_without_a_path_loads_the_hub_copy(monkeypatch, aime24_path):
    """No path and no $TRIAGE_AIME24: the hub's AIME-2024 (never a folder outside the package);
    $TRIAGE_AIME24 names a local file."""
    from triage.experiments import data

    calls = []
    monkeypatch.delenv("TRIAGE_AIME24", raising=False)
    monkeypatch.setattr(data, "load_aime_2024", lambda unique=True: calls.append(unique) or "hub")
    assert data.load_aime24() == "hub" and calls == [True]
    monkeypatch.setenv("TRIAGE_AIME24", str(aime24_path))
    assert data.load_aime24().num_rows == 30 and calls == [True]


def test_synthetic_problems_are_pinned():
    """The generator's exact outputs (committed SFT/RL results, level 6 above all, depend on them): a hash of
    every level's first problems, both splits, and of a held-out-filtered level-6 training set."""
    import hashlib

    h = hashlib.sha256()
    for difficulty in range(1, 7):
        for split in ("train", "eval"):
            for i in range(8):
                h.update(json.dumps(synthetic_problem(difficulty, 3, i, split), sort_keys=True).encode())
    assert h.hexdigest() == "e8f0e354e1f6429fddf9bdb9afd006356c3f14b8df0a808cbadd91f16de45e5a"
    rows = synthetic_math(16, [6], seed=0, split="train", held_out=8).to_list()
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    assert digest == "72117fc70c0adf6e2616b80d524f391149712c4c23d1d58a1150deafdda112aa"
