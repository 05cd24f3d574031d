"""SFT pre-training: tokenisation and loss mask, schedule, training that really learns, greedy accuracy,
checkpoint reuse and its errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from triage.experiments.data import dapo_row, synthetic_math
from triage.experiments.sft import (
    SFT_FILE,
    SFTConfig,
    build_sft_tokenizer,
    ensure_sft_checkpoint,
    greedy_accuracy,
    tokenize_examples,
    train_sft,
)

# Memorise four level-1 problems: a 2-layer 64-wide model learns them in ~60 steps on CPU (100 for margin).
MEMORISE = SFTConfig(
    n_train=4,
    n_eval=4,
    difficulty=(1,),
    steps=100,
    batch_size=4,
    learning_rate=1e-2,
    warmup_steps=5,
    max_new_tokens=16,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_sft_tokenizer()


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    """(output dir, record) of an SFT run on four problems (``MEMORISE``)."""
    out = tmp_path_factory.mktemp("sft") / "ckpt"
    logs: list[str] = []
    record = train_sft(MEMORISE, out, log=logs.append, device="cpu")
    return out, record, logs


def test_tokenizer_splits_numbers_into_digits(tokenizer):
    ids = tokenizer("12 + 345 = 357.\nAnswer: 357", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == "12 + 345 = 357.\nAnswer: 357"
    assert all(len(p.strip()) <= 1 for p in pieces if any(ch.isdigit() for ch in p)), pieces


def test_tokenize_examples_masks_the_prompt_and_padding(tokenizer):
    data = synthetic_math(3, [1, 3], seed=0)
    ids, mask, labels = tokenize_examples(tokenizer, data)
    for i, row in enumerate(data):
        prompt = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        n = int(mask[i].sum())
        assert ids[i, : len(prompt)].tolist() == prompt
        assert (labels[i, : len(prompt)] == -100).all() and (labels[i, n:] == -100).all()
        target = labels[i, len(prompt) : n].tolist()
        assert target == ids[i, len(prompt) : n].tolist()
        assert target[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(target[:-1]) == row["extra_info"]["solution"]
        assert (ids[i, n:] == tokenizer.pad_token_id).all()


def test_a_row_without_solution_is_an_error_naming_it(tokenizer):
    from datasets import Dataset

    from triage.experiments.data import FEATURES

    rows = [
        dapo_row("Compute 1 + 1.", 2, index="ok", solution="1 + 1 = 2.\nAnswer: 2"),
        dapo_row("Compute 2.", 2, index="bad"),
    ]
    with pytest.raises(ValueError, match="row 1 .*bad.* no worked solution"):
        tokenize_examples(tokenizer, Dataset.from_list(rows, features=FEATURES))


@pytest.mark.parametrize(
    "bad",
    [
        dict(steps=0),
        dict(batch_size=-1),
        dict(learning_rate=0.0),
        dict(min_lr_ratio=2.0),
        dict(target_accuracy=0.5),  # no eval_every: nothing would ever check it
        dict(target_accuracy=1.5, eval_every=5),
    ],
)
def test_config_errors(bad):
    with pytest.raises(ValueError, match="SFTConfig"):
        SFTConfig(**bad)


def test_sft_learns_and_greedy_accuracy_scores_it(memorised, tokenizer):
    out, record, logs = memorised
    assert record["loss"][-1]["loss"] < 0.1 * record["loss"][0]["loss"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    train = synthetic_math(4, [1], seed=0, held_out=4)  # the four problems it was trained on
    acc = greedy_accuracy(model, tok, train, max_new_tokens=16)
    assert acc == {"accuracy": 1.0, "by_difficulty": {"1": 1.0}, "n": 4}
    # the same completions against wrong ground truths score 0: the accuracy is the DAPO rule, not a constant
    wrong = train.map(lambda r: {"reward_model": {**r["reward_model"], "ground_truth": "999"}})
    assert greedy_accuracy(model, tok, wrong, max_new_tokens=16)["accuracy"] == 0.0
    saved = json.loads((out / SFT_FILE).read_text())
    assert saved["config"] == MEMORISE.to_dict() and saved["steps_done"] == 100
    assert any("SFT done" in line for line in logs)


def test_checkpoint_is_reused_for_the_same_config_and_refused_for_another(memorised, monkeypatch):
    out, record, _ = memorised
    import triage.experiments.sft as sft

    monkeypatch.setattr(sft, "train_sft", lambda *a, **k: pytest.fail("retrained an existing checkpoint"))
    logs: list[str] = []
    assert ensure_sft_checkpoint(MEMORISE, out, log=logs.append)["final"] == record["final"]
    assert "reusing" in logs[0]
    with pytest.raises(ValueError, match=r"another config \(differs in \['steps'\]\)"):
        ensure_sft_checkpoint(SFTConfig.from_dict({**MEMORISE.to_dict(), "steps": 101}), out)


def test_evaluations_more_often_than_loss_logging(tmp_path):
    """``eval_every`` below the 50-step loss window: each evaluation line reports the loss up to its step."""
    cfg = SFTConfig.from_dict({**MEMORISE.to_dict(), "steps": 6, "eval_every": 2, "n_eval": 2})
    logs: list[str] = []
    record = train_sft(cfg, tmp_path / "ckpt", log=logs.append, device="cpu")
    assert [e["step"] for e in record["eval"]] == [2, 4, 6]
    assert [entry["step"] for entry in record["loss"]] == [2, 4, 6]
    assert sum("held-out greedy accuracy" in line for line in logs) == 3


def test_a_checkpoint_of_another_config_names_every_differing_field(tmp_path):
    """A field the checkpoint's config has and this one leaves out (``to_dict`` drops an unset
    ``target_accuracy``) is named in the error too."""
    (tmp_path / "config.json").write_text("{}")
    ran = {**MEMORISE.to_dict(), "target_accuracy": 0.5}
    (tmp_path / SFT_FILE).write_text(json.dumps({"config": ran, "final": {}}))
    with pytest.raises(ValueError, match=r"another config \(differs in \['target_accuracy'\]\)"):
        ensure_sft_checkpoint(MEMORISE, tmp_path)


def test_target_accuracy_stops_at_the_first_evaluation_that_reaches_it(tmp_path, monkeypatch):
    import triage.experiments.sft as sft

    accuracies = iter([0.25, 0.75, 0.75])  # two evaluations (steps 2 and 4), then the final one
    monkeypatch.setattr(
        sft, "greedy_accuracy", lambda *a, **k: {"accuracy": next(accuracies), "by_difficulty": {}, "n": 4}
    )
    cfg = SFTConfig.from_dict({**MEMORISE.to_dict(), "steps": 20, "eval_every": 2, "target_accuracy": 0.5})
    record = train_sft(cfg, tmp_path / "ckpt", log=lambda line: None, device="cpu")
    assert record["stopped_by"] == "target_accuracy" and record["steps_done"] == 4
    assert [e["step"] for e in record["eval"]] == [2, 4, 4] and record["config"]["target_accuracy"] == 0.5


def test_cli_overrides_any_field_an_unset_target_accuracy_too(tmp_path, monkeypatch):
    import triage.experiments.sft as sft
    from triage.experiments.ablate import SCALES

    assert SCALES["local"].sft.target_accuracy is None  # so the scale's to_dict() has no such key
    trained = []
    monkeypatch.setattr(sft, "train_sft", lambda config, output: trained.append(config))
    assert sft.main(["--scale", "local", "--output", str(tmp_path), "target_accuracy=0.6", "steps=10"]) == 0
    assert trained[0].target_accuracy == 0.6 and trained[0].steps == 10
    assert trained[0].model == SCALES["local"].sft.model
    sft.main(["--scale", "local", "--output", str(tmp_path), "hidden_size=256"])  # a model field
    assert trained[1].model == dataclasses.replace(SCALES["local"].sft.model, hidden_size=256)
    with pytest.raises(SystemExit):
        sft.main(["--scale", "local", "--output", str(tmp_path), "nope=1"])


def test_config_dict_is_the_flat_sft_json_layout_and_round_trips():
    """``to_dict`` keeps the layout of the ``sft.json`` files on disk (the model shape flat beside the other
    fields, the optional fields absent at their defaults), so existing checkpoints still match."""
    from triage.trainers.tiny import TinyModelSpec

    old_layout = {  # the config of an sft.json written before SFTConfig held a TinyModelSpec
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "difficulty": [1], "n_train": 4, "n_eval": 4, "seed": 0,
        "steps": 100, "max_seconds": None, "batch_size": 4, "learning_rate": 0.01, "weight_decay": 0.01,
        "warmup_steps": 5, "min_lr_ratio": 0.1, "eval_every": 0, "max_new_tokens": 16, "eval_batch_size": 256,
    }  # fmt: skip
    assert MEMORISE.to_dict() == old_layout and SFTConfig.from_dict(old_layout) == MEMORISE
    wide = dataclasses.replace(MEMORISE, model=TinyModelSpec(hidden_size=128, vocab_size=1024))
    assert wide.to_dict()["vocab_size"] == 1024 and SFTConfig.from_dict(wide.to_dict()) == wide
    with pytest.raises(ValueError, match=r"SFTConfig: unknown fields \['hidden'\]"):
        SFTConfig.from_dict({**old_layout, "hidden": 3})


def test_a_checkpoint_of_the_old_sft_json_layout_is_reused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    final = {"accuracy": 0.5, "by_difficulty": {"1": 0.5}}
    (tmp_path / SFT_FILE).write_text(json.dumps({"config": MEMORISE.to_dict(), "final": final}))
    assert ensure_sft_checkpoint(MEMORISE, tmp_path, log=lambda line: None)["final"] == final
