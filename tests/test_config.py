"""Config composition of every recipe/experiment, schema validation and derived DeepSpeed keys."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from pardec.common.errors import ConfigError
from pardec.trainers.deepspeed_config import build_deepspeed_config
from tests.train_utils import RECIPES, compose_train

EXPERIMENTS = sorted(p.stem for p in (RECIPES / "experiment").glob("*.yaml"))
RECIPE_NAMES = sorted(p.stem for p in (RECIPES / "recipe").glob("*.yaml"))
DEEPSPEED = sorted(p.stem for p in (RECIPES / "deepspeed").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = compose_train([f"experiment={experiment}"])
    assert cfg.experiment_name == experiment
    assert cfg.recipe.name in RECIPE_NAMES


LORA_EXPERIMENTS = [e for e in EXPERIMENTS if e.startswith("smollm2_") and e.endswith("_lora")]


@pytest.mark.parametrize("experiment", LORA_EXPERIMENTS)
def test_lora_experiment_is_its_base_with_the_rank64_keys_set(experiment):
    """``lora/rank64.yaml`` sets four keys over an experiment, whether an experiment includes it or the
    command line adds it (``+lora=rank64``); the reference sets them one by one."""
    base = experiment.removesuffix("_lora")
    by_hand = ["model.gradient_checkpointing=false", "model.lora.rank=64", "model.lora.alpha=64.0", "trainer.lr=5e-4"]
    expected = without_name(compose_train([f"experiment={base}", *by_hand]))
    assert without_name(compose_train([f"experiment={experiment}"])) == expected
    assert without_name(compose_train([f"experiment={base}", "+lora=rank64"])) == expected
    assert compose_train([f"experiment={experiment}", "trainer.lr=1e-3"]).trainer.lr == 1e-3  # still overridable


def without_name(cfg) -> dict:
    """The config without the experiment's name, its interpolations unresolved (paths named after it stay equal)."""
    return {k: v for k, v in OmegaConf.to_container(cfg).items() if k not in ("experiment_name", "output_dir")}


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_every_recipe_composes(recipe):
    assert compose_train([f"recipe={recipe}"]).recipe.name == recipe


@pytest.mark.parametrize("zero", DEEPSPEED)
def test_every_deepspeed_option_composes(zero):
    cfg = compose_train([f"deepspeed={zero}"])
    assert cfg.deepspeed.stage in (0, 1, 2, 3)


def test_mistyped_key_fails_naming_it():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as err:
        compose_train(["trainer.lrr=1e-5"])
    assert "lrr" in str(err.value) + str(err.value.__cause__)


def test_added_unknown_key_fails_naming_it():
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ConfigError)) as err:
        compose_train(["+model.hiden_size=3"])
    assert "hiden_size" in str(err.value) + str(err.value.__cause__)


def test_unknown_recipe_key_fails_naming_it():
    with pytest.raises(ConfigError, match="bogus_key"):
        compose_train(["+recipe.bogus_key=1"])


def test_bad_choice_fails_naming_key_and_choices():
    """A typed choice is refused while Hydra composes (the CLI prints both lines)."""
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(["data.length_policy=sometimes"])
    message = f"{err.value}\n{err.value.__cause__}"
    assert "full_key: data.length_policy" in message
    assert "Invalid value 'sometimes', expected one of [truncate, drop, error]" in message


def test_unknown_recipe_name_lists_known_ones():
    with pytest.raises(ConfigError, match="recipe.name"):
        compose_train(["recipe.name=nonexistent"])


def test_deepspeed_batch_keys_are_derived():
    cfg = compose_train(["trainer.micro_batch_size=3", "trainer.grad_accum=5", "deepspeed=zero2"])
    ds = build_deepspeed_config(cfg, world_size=8, bf16=True)
    assert ds["train_batch_size"] == 3 * 5 * 8
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 5
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] is True


def test_offload_needs_a_zero_stage():
    # refused at start (validation builds the DeepSpeed config), not when the engine is created
    with pytest.raises(ConfigError, match="offload_optimizer"):
        compose_train(["deepspeed.offload_optimizer=true"])


def test_flex_kernel_options_compose_from_the_command_line_and_need_pardec_flex(tmp_path):
    """docs/guide/gpu_nodes.md's override gives a dict; a run that does not use pardec_flex (CPU: sdpa) stops before
    training with an error naming the key."""
    from tests.train_utils import run_in_process

    override = "model.flex_kernel_options={BLOCK_M:64,BLOCK_N:64,num_stages:3,num_warps:4}"
    cfg = compose_train([override])
    assert dict(cfg.model.flex_kernel_options) == {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 3, "num_warps": 4}
    with pytest.raises(ConfigError, match="'model.flex_kernel_options'.*needs attn_implementation=pardec_flex"):
        run_in_process(["recipe=idlm", override, f"output_dir={tmp_path}"])
    assert not (tmp_path / "checkpoints").exists()
