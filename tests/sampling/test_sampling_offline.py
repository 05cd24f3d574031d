"""OfflineRollouts: k-th repeat -> k-th stored completion, file formats, prompt ids, errors naming the prompt."""

from __future__ import annotations

import json

import pytest

from triage.trainers.sampling import OfflineRollouts, RolloutValidationError, encode_prompts, make_sampler

CHAT_A = [{"role": "user", "content": "What is 12 + 35?"}]
CHAT_B = [{"role": "user", "content": "Compute 7 * 8 - 3."}]


def rows():
    out = []
    for name, prompt in (("a", CHAT_A), ("b", CHAT_B)):
        for k in range(3):
            out.append(
                {
                    "prompt": prompt,
                    "completion_ids": [10 + k, 20 + k, 2],
                    "sampler_logprobs": [-0.1 * (k + 1), -0.2, -0.3],
                    "tag": f"{name}{k}",
                }
            )
    return out


def write_jsonl(path, data):
    path.write_text("\n".join(json.dumps(r) for r in data) + "\n", encoding="utf-8")
    return path


def test_kth_repeat_gets_kth_completion_and_calls_restart(tmp_path, fake_trainer, tokenizer):
    source = OfflineRollouts(write_jsonl(tmp_path / "r.jsonl", rows()), forward_columns=["tag"])
    assert len(source) == 6
    prompts = [CHAT_A, CHAT_A, CHAT_B, CHAT_B]  # num_generations = 2
    out = source(prompts, fake_trainer)
    assert out["tag"] == ["a0", "a1", "b0", "b1"]
    assert out["completion_ids"] == [[10, 20, 2], [11, 21, 2], [10, 20, 2], [11, 21, 2]]
    assert out["logprobs"][1] == [-0.2, -0.2, -0.3]
    assert out["prompt_ids"] == encode_prompts(prompts, tokenizer)  # encoded like TRL when not stored
    assert source(prompts, fake_trainer)["tag"] == ["a0", "a1", "b0", "b1"]  # a later epoch replays


def test_not_enough_stored_and_unknown_prompt(fake_trainer):
    source = OfflineRollouts(rows())
    with pytest.raises(
        ValueError, match="'What is 12 \\+ 35\\?' is requested 4\\+ times .* only 3 completion"
    ):
        source([CHAT_A] * 4, fake_trainer)
    with pytest.raises(KeyError, match="no stored completion for prompt 'Other'"):
        source([[{"role": "user", "content": "Other"}]] * 2, fake_trainer)


def test_stored_prompt_ids_configurable_columns_and_parquet(tmp_path, fake_trainer):
    import datasets

    data = [
        {"question": "What is 1 + 1?", "ids": [5, 6], "out": [7, 2], "lp": [-1.0, -0.5]},
        {"question": "What is 1 + 1?", "ids": [5, 6], "out": [8, 2], "lp": [-2.0, -0.5]},
    ]
    path = tmp_path / "r.parquet"
    datasets.Dataset.from_list(data).to_parquet(str(path))
    for store in (path, datasets.Dataset.from_list(data)):
        source = make_sampler(
            "offline",
            data=store,
            prompt_column="question",
            completion_column="out",
            logprobs_column="lp",
            prompt_ids_column="ids",
        )
        out = source(["What is 1 + 1?"] * 2, fake_trainer)
        assert out["prompt_ids"] == [[5, 6], [5, 6]] and out["completion_ids"] == [[7, 2], [8, 2]]


def test_chat_prompts_match_despite_null_fields_added_by_datasets(fake_trainer):
    stored = [dict(r, prompt=[{**m, "tool_calls": None} for m in r["prompt"]]) for r in rows()]
    out = OfflineRollouts(stored)([CHAT_B], fake_trainer)
    assert out["completion_ids"] == [[10, 20, 2]]


def test_multi_process_offset_counts_repeats_globally():
    source = OfflineRollouts(rows())
    everything = [CHAT_A, CHAT_A, CHAT_A, CHAT_B]  # a group straddling two ranks: rank 1 holds entries 2..3
    out = source.rollout(everything, offset=2, count=2)
    assert out["completion_ids"] == [[12, 22, 2], [10, 20, 2]]


def test_broken_exports_fail_at_load_naming_the_row(tmp_path):
    bad = rows()
    bad[4]["sampler_logprobs"] = [-0.1, float("nan"), -0.3]
    with pytest.raises(RolloutValidationError, match="(?s)row index.*sample 4 .*position 1.*NaN"):
        OfflineRollouts(bad)
    bad = rows()
    bad[1]["completion_ids"] = [10, 2]
    with pytest.raises(RolloutValidationError, match="sample 1 .*3 log-probs"):
        OfflineRollouts(bad)
    with pytest.raises(ValueError, match="row 2: missing column\\(s\\) \\['sampler_logprobs'\\]"):
        OfflineRollouts(
            [r if i != 2 else {"prompt": "x", "completion_ids": [1]} for i, r in enumerate(rows())]
        )
    (tmp_path / "broken.jsonl").write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not a JSON line"):
        OfflineRollouts(tmp_path / "broken.jsonl")
    with pytest.raises(FileNotFoundError):
        OfflineRollouts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="store is empty"):
        OfflineRollouts([])


def test_vocabulary_is_checked_at_call_time(fake_trainer):
    data = rows()
    data[0]["completion_ids"] = [10_000, 20, 2]
    source = OfflineRollouts(data)  # no vocabulary at load time
    with pytest.raises(RolloutValidationError, match="sample 0 .*token id 10000 is not in"):
        source([CHAT_A], fake_trainer)
