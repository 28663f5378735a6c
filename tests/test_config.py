"""Configuration: composed from conf/, typed, validated once with messages naming key and allowed values."""

import pytest
from hydra import compose, initialize_config_module

from draftsmith.pipeline.config import ConfigError, DistillLoss, register_schema, validate

register_schema()


def composed(*overrides: str):
    with initialize_config_module(config_module="draftsmith.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_defaults_validate_to_typed_config():
    cfg = validate(composed())
    assert cfg.distill.loss is DistillLoss.forward_kl
    assert cfg.target.name_or_path == "demo"
    assert cfg.evaluate.min_alpha == 0.1 and cfg.evaluate.max_tau_loss == 0.03  # the demo's own alpha gate
    assert cfg.distill.max_steps == 200 and cfg.distill.teacher.top_k_logits == 64  # preset=demo is the default
    assert cfg.distill.freeze_embeddings and cfg.data.max_prompts == 600
    assert cfg.quantize.rounding.value == "gptq"


def test_gpu_preset_changes_budgets():
    cfg = validate(composed("preset=gpu"))
    assert cfg.device.value == "cuda" and cfg.distill.max_steps == 8000 and cfg.distill.compile and cfg.distill.teacher.top_k_logits == 0
    assert not cfg.distill.freeze_embeddings and cfg.distill.teacher.extra_samples == 15
    assert cfg.evaluate.min_alpha == 0.55  # the production alert threshold, outside the demo


def test_the_qwen_coder_preset_resolves_to_three_drafts_of_a_real_target():
    with initialize_config_module(config_module="draftsmith.conf", version_base="1.3"):
        sweep = compose(config_name="config", overrides=["preset=qwen_coder"], return_hydra_config=True).hydra.sweeper.params
    assert dict(sweep) == {"draft": "eagle3,from_target,sibling"}  # `draftsmith run -m preset=qwen_coder`: one job each
    jobs = {draft: validate(composed("preset=qwen_coder", f"draft={draft}")) for draft in ("eagle3", "from_target", "sibling")}
    for cfg in jobs.values():  # the gpu preset's budgets, the real target and its domain data
        assert cfg.device.value == "cuda" and cfg.distill.max_steps == 800 and cfg.draft.vocab_size == 16384
        assert cfg.target.name_or_path.endswith("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
        assert cfg.data.path.endswith("code_prompts.jsonl") and cfg.data.eval_fraction == 0.2 and cfg.distill.keep_best
        assert cfg.distill.target_states_gib == 32  # the head's states for every answer kept on the device
    assert jobs["eagle3"].draft.kind.value == "eagle3" and jobs["from_target"].draft.init.value == "from_target"
    sibling = jobs["sibling"].draft
    assert sibling.kind.value == "standalone" and sibling.init.value == "pretrained" and sibling.lora_rank == 16
    assert jobs["from_target"].draft.lora_rank == 0  # a draft of the target's layers trains every weight
    assert sibling.pretrained_path.endswith("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


def test_the_eagle3_sweep_resolves_to_a_grid_of_heads():
    with initialize_config_module(config_module="draftsmith.conf", version_base="1.3"):
        sweep = compose(config_name="config", overrides=["preset=eagle3_sweep"], return_hydra_config=True).hydra.sweeper.params
    assert dict(sweep) == {"distill.teacher.extra_samples": "3,15", "distill.max_steps": "2000,4000", "draft.ttt_steps": "4,7"}
    cfg = validate(composed("preset=eagle3_sweep", "distill.teacher.extra_samples=15", "distill.max_steps=4000", "draft.ttt_steps=7"))
    assert cfg.draft.kind.value == "eagle3" and cfg.device.value == "cuda" and cfg.distill.compile  # the gpu preset's, for a head
    assert (cfg.distill.teacher.extra_samples, cfg.distill.max_steps, cfg.draft.ttt_steps) == (15, 4000, 7)
    assert (cfg.distill.batch_size, cfg.distill.learning_rate, cfg.distill.teacher.batch_size) == (128, 1e-3, 128)
    assert cfg.distill.target_states_gib == 32
    best = validate(composed("preset=eagle3_sweep"))  # without -m: the best head measured so far
    assert (best.distill.teacher.extra_samples, best.distill.max_steps, best.draft.ttt_steps) == (15, 2000, 7)


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "distill.loss=kl",
            r"Invalid value 'kl', expected one of \[forward_kl, reverse_kl, jsd, tvd, hard_label\](.|\n)*full_key: distill.loss",
        ),
        ("device=tpu", r"Invalid value 'tpu', expected one of \[auto, cpu, cuda\](.|\n)*full_key: device"),
        ("draft.init=copy", r"expected one of \[from_target, scratch, pretrained\](.|\n)*full_key: draft.init"),
    ],
)
def test_enum_values_are_refused_at_composition(override, message):
    with pytest.raises(Exception) as refused:
        composed(override)
    import re

    assert re.search(message, f"{refused.value}\n{refused.value.__cause__}")


@pytest.mark.parametrize(
    "override,message",
    [
        ("quantize.bits=3", r"quantize.bits=3: fewer than 4 bits is refused"),
        ("quantize.group_size=100", r"quantize.group_size=100 is not allowed: null \(auto\), 32, 64 or 128"),
        ("data.eval_fraction=1.5", r"data.eval_fraction=1.5 is not allowed: a fraction in \(0, 1\)"),
        ("distill.max_steps=0", r"distill.max_steps=0 is not allowed: 1 or more"),
        ("evaluate.speed_repeats=0", r"evaluate.speed_repeats=0 is not allowed: 1 or more"),
        ("serve.max_model_len=8", r"serve.max_model_len=8 is not allowed: 16 or more"),
        ("distill.on_policy_fraction=1.5", r"distill.on_policy_fraction=1.5 is not allowed: a fraction in \[0, 1\]"),
        ("distill.on_policy_fraction=0.5,distill.loss=hard_label", r"0 with distill.loss=hard_label"),
        ("distill.on_policy_fraction=0.5,draft=eagle3", r"0 for draft=eagle3"),
        ("draft=eagle3,draft.ttt_steps=0", r"draft.ttt_steps=0 is not allowed: 1 or more"),
    ],
)
def test_bad_values_name_the_key_and_allowed_values(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(composed(*override.split(",")))


def test_wrong_type_is_refused():
    with pytest.raises(Exception, match="distill.max_steps"):
        validate(composed("distill.max_steps=many"))


def test_cluster_launchers_compose_with_draftsmith_defaults():
    with initialize_config_module(config_module="draftsmith.conf", version_base="1.3"):
        slurm = compose(
            config_name="config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], return_hydra_config=True
        ).hydra.launcher
        local = compose(config_name="config", overrides=["hydra/launcher=local"], return_hydra_config=True).hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and local._target_.endswith("LocalLauncher")
    assert (slurm.partition, slurm.gpus_per_node, slurm.timeout_min, slurm.max_num_timeout) == ("gpu", 1, 240, 3)
    assert local.timeout_min == 1440  # not submitit's 60 minutes, which would kill a GPU pipeline
