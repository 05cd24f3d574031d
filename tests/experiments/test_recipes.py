"""Recipes, accelerate configs and the cluster launcher: every shipped config file parses and validates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from triage.experiments import recipes
from triage.experiments.recipes import (
    ALL_ARMS,
    ARMS,
    FOLLOW_UP_ARMS,
    PRESETS,
    build_config,
    load_recipe,
    parse_overrides,
    recipe_names,
    split_recipe,
    validate_recipe,
)

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "experiments"
ACCELERATE_CONFIGS = sorted((EXPERIMENTS / "accelerate").glob("*.yaml"))
RECIPE_FILES = sorted((EXPERIMENTS / "recipes").rglob("*.yaml"))


def test_every_shipped_yaml_parses_to_a_mapping():
    assert {p.stem for p in (EXPERIMENTS / "recipes" / "arms").glob("*.yaml")} == set(ALL_ARMS)
    assert not set(ARMS) & set(FOLLOW_UP_ARMS)
    assert {p.stem for p in (EXPERIMENTS / "recipes" / "presets").glob("*.yaml")} == set(PRESETS)
    assert {p.stem for p in ACCELERATE_CONFIGS} == {"ddp", "fsdp2", "zero3", "single_gpu", "cpu"}
    for path in RECIPE_FILES + ACCELERATE_CONFIGS:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path


@pytest.mark.parametrize("name", recipe_names())
def test_every_preset_arm_validates_and_builds(name):
    recipe = load_recipe(name)
    validate_recipe(recipe, build=True)  # TriageGRPOConfig(...) constructed on CPU
    config = build_config(recipe, output_dir="unused", use_cpu=True, bf16=False)
    # DAPO mapped to TRL
    assert (config.loss_type, config.epsilon, config.epsilon_high, config.beta) == ("dapo", 0.2, 0.28, 0.0)
    assert (config.num_generations, config.temperature, config.top_p) == (16, 1.0, 1.0)
    assert config.mask_truncated_completions is False
    # no TRL-side correction in any arm, TRIAGE's `correction` is the only one
    assert config.vllm_importance_sampling_correction is False and config.off_policy_mask_threshold is None
    # NVFP4 learner
    assert config.learner_precision == "nvfp4" and recipe["quant_recipe"]["scale"] == "tensor"
    arm = name.split("/")[1]
    expected = {
        "grpo-none": "none",
        "tis": "tis",
        "icepop": "icepop",
        "opsm": "opsm",
        "seq-mis-trl": "seq-mis",
    }
    expected = expected.get(arm, "triage")
    assert config.triage_config().correction == expected
    assert [f.__name__ for f in recipes_reward_funcs(recipe)] == ["dapo_accuracy", "soft_overlong_penalty"]


def recipes_reward_funcs(recipe):
    from triage.trainers.rewards import build_reward_funcs

    return build_reward_funcs(recipe["reward_funcs"], recipe["max_completion_length"])


def test_vanilla_arm_switches_trl_correction_off_explicitly():
    arm = yaml.safe_load((EXPERIMENTS / "recipes" / "arms" / "grpo-none.yaml").read_text())
    assert arm["correction"] == "none" and arm["vllm_importance_sampling_correction"] is False
    # without it TriageGRPOConfig (like GRPOConfig) would turn TRL's sequence-mask IS on for correction=none
    recipe = load_recipe("tiny/grpo-none", {"vllm_importance_sampling_correction": None})
    assert build_config(
        recipe, output_dir="unused", use_cpu=True, bf16=False
    ).vllm_importance_sampling_correction


def test_arms_differ_only_in_correction_fields():
    base = load_recipe("qwen3-4b/grpo-none")
    triage_fields = set(__import__("triage").TriageConfig.field_names()) | {"description"}
    for arm in ALL_ARMS:
        recipe = load_recipe(f"qwen3-4b/{arm}")
        changed = {k for k in recipe.keys() | base.keys() if recipe.get(k) != base.get(k)}
        assert changed <= triage_fields, (arm, changed)
    from triage import TriageConfig

    def triage_fields_of(arm):
        recipe = load_recipe(f"tiny/{arm}")
        return TriageConfig(**{k: recipe[k] for k in TriageConfig.field_names() if k in recipe})

    # the `triage` arm is exactly the library default, the other profiles by name
    assert triage_fields_of("triage") == TriageConfig()
    assert triage_fields_of("triage-keep-down") == TriageConfig.profile("keep-down")
    assert triage_fields_of("triage-suppress-down") == TriageConfig.profile("suppress-down")
    trl = triage_fields_of("seq-mis-trl")  # TRL's sequence_mask default (C_max 3, no C_min), applied once
    assert (trl.correction, trl.seq_mis_level, trl.seq_mis_low, trl.seq_mis_high) == (
        "seq-mis",
        "product",
        0.0,
        3.0,
    )
    assert load_recipe("tiny/seq-mis-trl")["vllm_importance_sampling_correction"] is False
    mask = load_recipe("tiny/triage-mask")
    assert (mask["amplify_up"], mask["amplify_down"]) == ("mask", "is")
    assert {k for k in TriageConfig.field_names() if mask.get(k) != load_recipe("tiny/triage").get(k)} == {
        "amplify_up"
    }  # one field apart from the default
    no_is = load_recipe("tiny/triage-no-is")
    assert (no_is["consistent"], no_is["correct_down"], no_is["amplify_down"]) == ("keep", "keep", "keep")
    no_guard, no_floor, soft_only = (
        load_recipe("tiny/triage-suppress-no-guard"),
        load_recipe("tiny/triage-suppress-no-floor"),
        load_recipe("tiny/triage-suppress-soft-only"),
    )
    assert (no_guard["guard_kappa"], no_guard["tail_floor"], no_guard["amplify_down"]) == (None, 3.0, "soft")
    assert (no_floor["guard_kappa"], no_floor["tail_floor"], no_floor["amplify_down"]) == (0.1, None, "soft")
    assert (soft_only["guard_kappa"], soft_only["tail_floor"], soft_only["amplify_down"]) == (
        None,
        None,
        "soft",
    )


def test_probability_space_arms():
    """`prime-rl-mask` is prime-rl's default mask (τ 0.2 in probability, amplify-down and amplify-up masked,
    all else kept); `triage-prob-mask-both` differs from it in correct-up only, `triage-prob-mask-down` in
    amplify-up only; every other arm stays in log space."""
    from triage import TriageConfig

    def config_of(arm):
        recipe = load_recipe(f"tiny/{arm}")
        return TriageConfig(**{k: recipe[k] for k in TriageConfig.field_names() if k in recipe})

    prime = config_of("prime-rl-mask")
    policies = ("consistent", "amplify_down", "correct_up", "amplify_up", "correct_down")
    assert (prime.correction, prime.tau_space, prime.tau) == ("triage", "prob", 0.2)
    assert [getattr(prime, p) for p in policies] == ["keep", "mask", "keep", "mask", "keep"]
    assert (prime.tail_floor, prime.guard_kappa) == (None, None)
    assert config_of("triage-prob-mask-both") == TriageConfig(**{**prime.to_dict(), "correct_up": "mask"})
    assert config_of("triage-prob-mask-down") == TriageConfig(**{**prime.to_dict(), "amplify_up": "keep"})
    prob_arms = {"prime-rl-mask", "triage-prob-mask-both", "triage-prob-mask-down"}
    assert prob_arms <= set(FOLLOW_UP_ARMS)
    for arm in ALL_ARMS:
        recipe = load_recipe(f"tiny/{arm}")
        assert recipe.get("tau_space", "log") == ("prob" if arm in prob_arms else "log"), arm
        if arm in prob_arms:
            assert recipe["vllm_importance_sampling_correction"] is False
            config = build_config(recipe, output_dir="unused", use_cpu=True, bf16=False)
            assert config.triage_config() == config_of(arm)


def test_presets():
    small = load_recipe("qwen3-4b/triage")
    moe = load_recipe("qwen3-30b-a3b/triage")
    tiny = load_recipe("tiny/triage")
    for recipe, processes in ((small, 16), (moe, 32)):
        launch = recipe["launch"]
        assert launch["train_nodes"] * launch["gpus_per_node"] == processes
        # DAPO: 512 completions per optimizer step, 8192 per rollout step
        assert (
            recipe["per_device_train_batch_size"] * processes * recipe["gradient_accumulation_steps"] == 512
        )
        assert recipe["generation_batch_size"] == 512 * 16
        assert recipe["max_completion_length"] == 20480 and recipe["use_vllm"] is True
        assert (
            recipe["dataset"]["source"] == "dapo-math-17k" and recipe["eval_dataset"]["source"] == "aime-2024"
        )
        assert launch["vllm_serve"]["kv_cache_dtype"] == "fp8"
        # verl's lr warm-up (10) counts rollout steps; TRL's warmup_steps counts optimizer steps (16 per rollout)
        assert recipe["warmup_steps"] == 10 * recipe["generation_batch_size"] // 512
    assert moe["launch"]["accelerate_config"] == "fsdp2"
    # tiny: NVFP4 sampler with per-token scales + fp8 KV vs the learner's tensor-wide amax
    assert tiny["sampler"] == "hf" and tiny["use_vllm"] is False
    assert (
        tiny["sampler_kwargs"]["quant_recipe"]["scale"] == "row" and tiny["quant_recipe"]["scale"] == "tensor"
    )
    assert tiny["sampler_kwargs"]["kv_cache_dtype"] == "fp8_e4m3"


def test_tiny_recipe_data_and_reward_wire_up():
    from triage.experiments.data import load_from_spec

    recipe = load_recipe("tiny/triage", ["dataset.n=16", "dataset.held_out=8", "eval_dataset.n=8"])
    train, held = load_from_spec(recipe["dataset"]), load_from_spec(recipe["eval_dataset"])
    assert len(train) == 16 and len(held) == 8
    assert not {r["extra_info"]["raw_problem"] for r in train} & {
        r["extra_info"]["raw_problem"] for r in held
    }
    accuracy, overlong = recipes_reward_funcs(recipe)
    completions = [[{"role": "assistant", "content": r["extra_info"]["solution"]}] for r in train]
    assert accuracy(completions=completions, reward_model=train["reward_model"]) == [1.0] * 16
    assert overlong(completion_ids=[[0] * 47, [0] * 56, [0] * 64]) == [0.0, -0.5, -1.0]  # L 64, cache 16


def test_overrides_and_files(tmp_path):
    assert parse_overrides(["a.b=1", "a.c=[1, 2]", "d=null"]) == {"a": {"b": 1, "c": [1, 2]}, "d": None}
    assert parse_overrides({"quant_recipe.scale": "row"}) == {"quant_recipe": {"scale": "row"}}
    # YAML 1.1 booleans other than true/false stay the text they are (eval_strategy=no is TRL's "no")
    assert parse_overrides(["eval_strategy=no", "a=On", "b=true", "c=FALSE"]) == {
        "eval_strategy": "no",
        "a": "On",
        "b": True,
        "c": False,
    }
    assert load_recipe("tiny/tis", ["eval_strategy=no"])["eval_strategy"] == "no"
    recipe = load_recipe("tiny/tis", ["quant_recipe.hadamard=true", "max_steps=3"])
    assert recipe["quant_recipe"]["hadamard"] is True and recipe["quant_recipe"]["profile"] == "te"
    assert recipe["max_steps"] == 3
    # a dataset with a new source replaces the old spec whole
    recipe = load_recipe("tiny/tis", {"dataset": {"source": "aime24"}})
    assert recipe["dataset"] == {"source": "aime24"}
    # YAML 1.1 fixes: 3e-5 is a float (PyYAML wants 3.0e-5); no/yes/on/off stay strings
    assert parse_overrides(["learning_rate=3e-5", "a=1E3", "b=1e", "c=1.5"]) == {
        "learning_rate": 3e-5, "a": 1000.0, "b": "1e", "c": 1.5
    }  # fmt: skip
    assert load_recipe("tiny/tis", ["learning_rate=3e-5"])["learning_rate"] == 3e-5
    # ... but the dotted overrides of one command line are gathered first, in any order
    for order in (["dataset.limit=5", "dataset.source=aime24"], ["dataset.source=aime24", "dataset.limit=5"]):
        assert parse_overrides(order) == {"dataset": {"limit": 5, "source": "aime24"}}
    mine = tmp_path / "mine.yaml"
    mine.write_text("preset: tiny\narm: icepop\nicepop_high: 3.0\nmodel_name_or_path: /ckpt\n")
    recipe = load_recipe(mine, {"icepop_low": 0.25})
    assert (recipe["correction"], recipe["icepop_low"], recipe["icepop_high"]) == ("icepop", 0.25, 3.0)
    assert recipe["model_name_or_path"] == "/ckpt" and "preset" not in recipe and "arm" not in recipe
    config, sections = split_recipe(recipe)
    assert set(sections) == {
        "model_name_or_path",
        "dataset",
        "eval_dataset",
        "reward_funcs",
        "launch",
        "description",
    }
    assert "correction" in config and "dataset" not in config
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_overrides(["max_steps"])
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="neither a recipe file nor PRESET/ARM"):
        load_recipe("triage")
    with pytest.raises(ValueError, match="unknown arm 'vanilla'"):
        load_recipe("tiny/vanilla")
    with pytest.raises(ValueError, match="unknown preset"):
        load_recipe("qwen3-8b/triage")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"epsilon_hi": 0.3}, "unknown recipe key 'epsilon_hi' \\(did you mean 'epsilon_high'\\?\\)"),
        ({"correction": "tis2"}, "TRIAGE fields: .*correction"),
        ({"amplify_down": "drop"}, "TRIAGE fields: .*amplify_down"),
        ({"icepop_low": 6.0}, "icepop_low"),
        ({"quant_recipe.scale": "token"}, "quant_recipe: QuantRecipe.scale"),
        ({"quant_recipe.blocks": "1x16"}, "unknown QuantRecipe field 'blocks' \\(did you mean 'block'\\?\\)"),
        ({"learner_precision": "bf16"}, "learner_precision is not 'nvfp4'"),
        ({"sampler_kwargs.quant_recipe.profile": "vllm"}, "sampler_kwargs.quant_recipe: QuantRecipe.profile"),
        ({"sampler_kwargs.kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"sampler_kwargs.temperatur": 1.0}, "sampler_kwargs: unknown key for sampler 'hf': 'temperatur'"),
        ({"sampler_kwargs.sede": 1}, "unknown key for sampler 'hf': 'sede' \\(did you mean 'seed'\\?\\)"),
        (
            {"sampler": "sglang"},
            "sampler_kwargs.precision applies to sampler 'hf' only, got sampler 'sglang'",
        ),
        ({"reward_funcs": ["dapo_accuracy", "format"]}, "reward_funcs: unknown reward 'format'"),
        ({"reward_funcs": [{"soft_overlong": {"cache_length": 100}}]}, "cache_length"),
        ({"dataset.difficulty": 9}, "difficulty must be an int in 1..6"),
        ({"dataset": {"source": "hub"}}, "dataset: unknown dataset source 'hub'"),
        ({"eval_dataset.nn": 3}, "eval_dataset: dataset source 'synthetic' does not take \\['nn'\\]"),
        ({"model_name_or_path": None}, "recipe needs 'model_name_or_path'"),
        ({"launch.nodes": 2}, "launch: unknown keys \\['nodes'\\]"),
        ({"launch.accelerate_config": "zero9"}, "launch.accelerate_config 'zero9'"),
        ({"launch.vllm_serve": {"kv_cache": "fp8"}}, "unknown `trl vllm-serve` arguments \\['kv_cache'\\]"),
        ({"launch.vllm_extra_args": "--quantization x"}, "vllm_extra_args must be a list"),
    ],
)
def test_validation_names_the_bad_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_recipe("tiny/triage", overrides)


def test_sampler_numerics_keys_need_the_hf_sampler():
    engine = {"use_vllm": False, "sampler": "sglang", "sampler_kwargs.base_url": "http://127.0.0.1:1"}
    assert load_recipe("qwen3-4b/triage", engine)["sampler"] == "sglang"
    for key, value in (("kv_cache_dtype", "fp8"), ("precision", "bf16")):
        with pytest.raises(ValueError, match=f"sampler_kwargs.{key} applies to sampler 'hf' only"):
            load_recipe("qwen3-4b/triage", {**engine, f"sampler_kwargs.{key}": value})


def test_build_catches_trl_batch_rules():
    recipe = load_recipe("tiny/triage", {"generation_batch_size": 500})  # not a multiple of 16 completions
    with pytest.raises(ValueError, match="generation_batch_size"):
        validate_recipe(recipe, build=True)


def test_accelerate_configs_are_valid_for_accelerate():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    launch_options = {action.dest for action in launch_command_parser()._actions}
    kinds = {}
    for path in ACCELERATE_CONFIGS:
        config = ClusterConfig.from_yaml_file(str(path))  # rejects unknown top-level keys
        kinds[path.stem] = str(config.distributed_type)
        raw = yaml.safe_load(path.read_text())
        for section in ("fsdp_config", "deepspeed_config"):
            unknown = [k for k in raw.get(section, {}) if k not in launch_options]
            assert not unknown, (path.name, section, unknown)  # `accelerate launch` maps these to its options
    assert kinds == {
        "ddp": "DistributedType.MULTI_GPU",
        "fsdp2": "DistributedType.FSDP",
        "zero3": "DistributedType.DEEPSPEED",
        "single_gpu": "DistributedType.NO",
        "cpu": "DistributedType.NO",
    }
    cpu = ClusterConfig.from_yaml_file(str(EXPERIMENTS / "accelerate" / "cpu.yaml"))
    assert cpu.use_cpu is True and str(cpu.mixed_precision) == "no" and cpu.num_processes == 1
    assert (
        yaml.safe_load((EXPERIMENTS / "accelerate" / "fsdp2.yaml").read_text())["fsdp_config"]["fsdp_version"]
        == 2
    )
    assert (
        yaml.safe_load((EXPERIMENTS / "accelerate" / "zero3.yaml").read_text())["deepspeed_config"][
            "zero_stage"
        ]
        == 3
    )
    for preset in PRESETS:  # every preset names a shipped accelerate config
        name = load_recipe(f"{preset}/triage")["launch"]["accelerate_config"]
        assert (EXPERIMENTS / "accelerate" / f"{name}.yaml").is_file()


def test_cpu_layer_makes_the_tiny_preset_a_laptop_run():
    """load_recipe(..., cpu=True): the tiny model built locally (the preset's SFT checkpoint exists only after
    an ablation), CPU and fp32 — the config builds on a machine without a GPU as it is, no use_cpu/bf16
    passed — a small geometry and eval; the KEY=VALUE overrides still win over the layer."""
    plain, cpu = load_recipe("tiny/triage"), load_recipe("tiny/triage", ["eval_steps=2"], cpu=True)
    assert plain["bf16"] is True and plain["model_name_or_path"] == "./runs/ablate/sft"
    assert cpu["model_name_or_path"] == "tiny" and cpu["use_cpu"] is True and cpu["bf16"] is False
    assert cpu["eval_dataset"] == {**plain["eval_dataset"], "limit": 16} and cpu["eval_steps"] == 2
    assert cpu["launch"]["accelerate_config"] == "cpu"
    config = build_config(cpu, output_dir="unused")
    assert config.use_cpu and not config.bf16 and config.max_steps == 8
    assert config.steps_per_generation == 4  # the preset's off-policy geometry, a quarter of the size
    # the other settings are the preset's: same correction, numerics, sampler
    same = {k for k in plain if plain[k] == cpu.get(k)}
    assert {"correction", "learner_precision", "quant_recipe", "sampler", "sampler_kwargs"} <= same


def test_recipes_cli_writes_a_flat_recipe(tmp_path, capsys):
    from triage.experiments.recipes.__main__ import main

    assert main(["--list"]) == 0
    assert capsys.readouterr().out.split() == recipe_names()
    out = tmp_path / "r.yaml"
    assert main(["tiny/opsm", "--set", "max_steps=7", "-o", str(out)]) == 0
    flat = yaml.safe_load(out.read_text())
    assert flat == load_recipe("tiny/opsm", ["max_steps=7"])
    assert load_recipe(out) == flat  # a written recipe loads back unchanged (no preset/arm keys)
    assert main(["tiny/opsm", "--cpu", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == load_recipe("tiny/opsm", cpu=True)


def test_launch_script_dry_run_slurm(tmp_path):
    """The SLURM path on a fake 3-node allocation: recipe resolved, vLLM on the last node, accelerate on
    the first two with the right machine count, processes, rendezvous and config."""
    script = EXPERIMENTS / "cluster" / "launch_multinode.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'n01\\nn02\\nn03\\n'\n")
    (fake / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NODELIST": "n[01-03]",
        "DRY_RUN": "1",
        "RUN_DIR": str(tmp_path / "run"),
        "PYTHON": sys.executable,
    }
    result = subprocess.run(
        ["bash", str(script), "qwen3-4b/triage", "--set", "max_steps=10"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("+ srun")]
    vllm = next(line for line in lines if "vllm-serve" in line)
    train = next(line for line in lines if "accelerate launch" in line)
    assert (
        "--nodelist=n03" in vllm and "--model Qwen/Qwen3-4B-Base" in vllm and "--kv_cache_dtype fp8" in vllm
    )
    assert "--nodelist=n01,n02" in train and "--num_machines 2 --num_processes 16" in train
    assert "--main_process_ip n01" in train and "--rdzv_backend c10d" in train
    assert f"--config_file {EXPERIMENTS / 'accelerate' / 'ddp.yaml'}" in train
    assert "-m triage train --config" in train
    written = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert written["vllm_server_host"] == "n03" and written["max_steps"] == 10
    assert written["output_dir"] == str(tmp_path / "run")
    validate_recipe(written)


def test_recipes_module_exports():
    assert recipes.RECIPE_DIR == EXPERIMENTS / "recipes"


def test_launch_script_manual_mode_requires_a_shared_run_dir(tmp_path):
    """Without RUN_DIR every node would write its own timestamped folder: manual mode refuses to start."""
    script = EXPERIMENTS / "cluster" / "launch_multinode.sh"
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_DIR", "SLURM_JOB_ID")}
    env.update(
        ROLE="train", NODE_RANK="1", MASTER_ADDR="n0", VLLM_HOST="n9", DRY_RUN="1", PYTHON=sys.executable
    )
    result = subprocess.run(
        ["bash", str(script), "qwen3-4b/triage"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "manual mode needs RUN_DIR" in result.stderr
    assert not (tmp_path / "runs").exists()
