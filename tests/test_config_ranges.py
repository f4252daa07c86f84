"""Typed choices and declared ranges of every config schema (pardec.common.config_fields; issue 40 §1,
issue 35 typed choices): a number outside its declared range or a word outside its choices is refused at
start, naming the key, the value and the range (or the allowed words), and every numeric field of every
schema declares its range."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import pardec.cli.validate  # noqa: F401  (registers the validate_schema config node)
from pardec.common.config_fields import RANGE, Choice, check_config, ranged
from pardec.common.errors import ConfigError
from pardec.inference.config import ValidateConfig, validate_validate_config
from pardec.inference.decoders import registry as decoders
from pardec.inference.decoders.isd import ISDDecoder, ISDDecoderConfig
from pardec.inference.decoders.registry import build_decoder, decoder_config
from pardec.methods import registry as recipes
from pardec.methods.refusion import ReFusionConfig, ReFusionMethod
from pardec.trainers.config import TrainConfig, resume_changes
from tests.train_utils import RECIPES, compose_train, run_in_process


def compose_validate(overrides: list[str]):
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose("validate", overrides=overrides)


# --- issue 40 §1: each case refused at start, naming key, value and range ---------------------------


@pytest.mark.parametrize("override,message", [
    ("trainer.lr=-1", "config key 'trainer.lr' = -1.0; expected > 0"),
    ("trainer.save_every=-1", "config key 'trainer.save_every' = -1; expected >= 0 (0 = off)"),
    ("trainer.export_every=-1", "config key 'trainer.export_every' = -1; expected >= 0 (0 = off)"),
    ("trainer.keep_checkpoints=-1", "config key 'trainer.keep_checkpoints' = -1; expected >= 0 (0 = keep all)"),
    ("trainer.log_every=0", "config key 'trainer.log_every' = 0; expected >= 1"),
])
def test_issue_cases_are_refused_naming_key_value_and_range(override, message):
    with pytest.raises(ConfigError) as err:
        compose_train([override])
    assert str(err.value) == message


def test_negative_lr_is_refused_before_any_data_work(tmp_path, monkeypatch):
    """Issue 40: the old run prepared the data, then failed in the optimiser with no key named."""
    import pardec.trainers.trainer as trainer

    def no_data(*args, **kwargs):
        raise AssertionError("data preparation started")

    monkeypatch.setattr(trainer, "load_raw_split", no_data)
    with pytest.raises(ConfigError, match=r"'trainer\.lr' = -1\.0; expected > 0"):
        run_in_process([f"output_dir={tmp_path / 'run'}", "trainer.lr=-1"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,key", [
    ("trainer.warmup_ratio=1.5", "trainer.warmup_ratio"),
    ("trainer.betas=[0.9,1.0]", "trainer.betas"),
    ("deepspeed.stage=4", "deepspeed.stage"),
    ("data.max_unk_rate=2.0", "data.max_unk_rate"),
    ("data.synthetic.num_train=-1", "data.synthetic.num_train"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens"),
    ("recipe=idlm recipe.stride=1", "recipe.stride"),
    ("recipe=mdm recipe.eps=0", "recipe.eps"),
    ("recipe=refusion recipe.slot_sizes=[4,0]", "recipe.slot_sizes"),
    ("recipe=jacobi_forcing recipe.num_prompts=0", "recipe.num_prompts"),
])
def test_ranges_are_checked_in_every_part_of_the_training_config(override, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}' = .*; expected"):
        compose_train(override.split())


def test_a_stage_override_outside_the_range_names_the_stage_and_key():
    with pytest.raises(ConfigError,
                       match=r"recipe\.stages\[0\] \('a'\): config key 'recipe\.stride' = 1; expected >= 2"):
        compose_train(["recipe=idlm", "recipe.stages=[{name: a, max_steps: 2, overrides: {stride: 1}}]"])


def test_validation_and_python_built_decoders_and_recipes_are_checked():
    with pytest.raises(ConfigError, match=r"'reference_batch_size' = 0; expected >= 1"):
        validate_validate_config(compose_validate(["checkpoint=/x", "reference_batch_size=0"]))
    with pytest.raises(ConfigError, match=r"'decoder\.tau' = -1\.0; expected >= 0"):
        validate_validate_config(compose_validate(["checkpoint=/x", "decoder=isd_greedy", "+decoder.tau=-1"]))
    with pytest.raises(ConfigError, match=r"'decoder\.draft_budget' = 0; expected >= 1"):
        build_decoder({"name": "cover", "draft_budget": 0}, None)
    with pytest.raises(ConfigError, match=r"'decoder\.spawn_ratio' = 0\.0; expected in \(0, 1\]"):
        decoder_config(decoders._resolve("multiblock")[1](spawn_ratio=0.0))
    with pytest.raises(ConfigError, match=r"'recipe\.in_order_prob' = 2\.0; expected in \[0, 1\]"):
        ReFusionMethod(ReFusionConfig(in_order_prob=2.0), tokenizer=None)
    with pytest.raises(ConfigError, match=r"'decoder\.max_new_tokens' = 0; expected >= 1"):
        decoder_config({"name": "ar", "max_new_tokens": 0})


# --- typed choices -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,words", [
    ("trainer.schedule", "cosine, linear, constant"),
    ("trainer.on_existing", "refuse, archive, delete"),
    ("logging.backend", "wandb, none"),
    ("model.dtype", "auto, float32, bfloat16, float16"),
    ("data.source", "synthetic, files, hub"),
    ("data.template", "auto, plain, chat"),
])
def test_a_bad_choice_names_the_key_and_the_choices(key, words):
    """Hydra refuses it while composing (the CLI prints both lines); a config built without Hydra gets
    the same words from validate_train_config."""
    with pytest.raises(ConfigCompositionException) as err:
        compose_train([f"{key}=bogus"])
    message = f"{err.value}\n{err.value.__cause__}"
    assert f"full_key: {key}" in message and f"Invalid value 'bogus', expected one of [{words}]" in message


def test_a_bad_recipe_or_decoder_choice_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"key 'recipe\.mask': Invalid value 'bogus', expected one of \[nc, nc_ic\]"):
        compose_train(["recipe=jacobi_forcing", "recipe.mask=bogus"])
    with pytest.raises(ConfigError, match=r"'decoder\.mode': Invalid value 'beam', expected one of \[greedy, sample\]"):
        validate_validate_config(compose_validate(["checkpoint=/x", "decoder=isd_greedy", "decoder.mode=beam"]))
    with pytest.raises(ConfigError, match=r"'decoder\.draft_mode' = 'top2'; expected one of \[sample, argmax\]"):
        ISDDecoder(ISDDecoderConfig(draft_mode="top2"), None)
    with pytest.raises(ConfigCompositionException) as err:
        compose_validate(["checkpoint=/x", "dtype=fp8"])
    assert "Invalid value 'fp8', expected one of [auto, float32, bfloat16, float16]" in str(err.value.__cause__)


def test_choices_stay_plain_strings_for_yaml_code_and_resume():
    cfg = compose_train(["trainer.schedule=linear", "recipe=mdm", "recipe.attention=block"])
    schedule = cfg.trainer.schedule
    assert schedule == "linear" and schedule != "cosine" and f"{schedule}" == str(schedule) == "linear"
    assert {"linear": 1}[schedule] == 1 and schedule in ("constant", "linear") and json.dumps(schedule) == '"linear"'
    assert cfg.recipe.attention == "block"
    saved = OmegaConf.to_container(OmegaConf.create(OmegaConf.to_yaml(cfg, resolve=True)), resolve=True)
    assert "schedule: linear" in OmegaConf.to_yaml(cfg) and saved["trainer"]["schedule"] == "linear"
    assert resume_changes(saved, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)) == ([], [])


def test_a_choice_member_must_be_named_by_its_word():
    with pytest.raises(TypeError, match="name a Choice member by its value"):
        class Bad(Choice):
            COSINE = "cosine"


@dataclasses.dataclass
class Inner:
    p: typing.Optional[float] = ranged(None, gt=0, le=1)


@dataclasses.dataclass
class Outer:
    sizes: typing.List[int] = ranged(default_factory=lambda: [1, 2], ge=1)
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_check_config_reads_ranges_of_nested_optional_and_list_fields():
    check_config(Outer())  # null skips the range
    with pytest.raises(ConfigError, match=r"'x\.inner\.p' = 0\.0; expected in \(0, 1\]"):
        check_config(Outer(inner=Inner(p=0.0)), "x")
    with pytest.raises(ConfigError, match=r"'sizes' = \[1, 0\]; expected every value >= 1"):
        check_config(OmegaConf.merge(OmegaConf.structured(Outer), {"sizes": [1, 0]}))
    with pytest.raises(ConfigError, match=r"'x\.inner\.p' = nan"):
        check_config(Outer(inner=Inner(p=float("nan"))), "x")


# --- every schema declares the range of every numeric field --------------------------------------------


def _schemas() -> list[type]:
    """Every config dataclass: the training tree, validation, every registered recipe and decoder config,
    and the dataclasses nested in them."""
    roots = [TrainConfig, ValidateConfig]
    roots += [recipes.recipe_schema(name) for name in recipes._RECIPES]
    roots += [decoders._resolve(name)[1] for name in decoders._DECODERS]
    found: list[type] = []
    while roots:
        cls = roots.pop()
        if cls in found:
            continue
        found.append(cls)
        for hint in typing.get_type_hints(cls).values():
            for t in (hint, *typing.get_args(hint)):
                if isinstance(t, type) and dataclasses.is_dataclass(t):
                    roots.append(t)
    return found


def _is_numeric(hint) -> bool:
    if hint in (int, float):
        return True
    return typing.get_origin(hint) in (typing.Union, list) and any(_is_numeric(a) for a in typing.get_args(hint))


SCHEMAS = _schemas()


def test_the_walk_reaches_every_kind_of_schema():
    names = {cls.__name__ for cls in SCHEMAS}
    assert {"TrainerConfig", "DataConfig", "SyntheticGSMConfig", "DeepSpeedConfig", "EvalConfig", "ModelConfig",
            "ValidateConfig", "IDLMLoraConfig", "JacobiForcingConfig", "MDMConfig", "ReFusionConfig",
            "CoverConfig", "ISDDecoderConfig", "MultiBlockDecoderConfig", "ReFusionDecoderConfig"} <= names
    assert len(SCHEMAS) >= 26


@pytest.mark.parametrize("cls", SCHEMAS, ids=lambda c: c.__name__)
def test_every_numeric_field_declares_a_range(cls):
    hints = typing.get_type_hints(cls)
    missing = [f.name for f in dataclasses.fields(cls) if _is_numeric(hints[f.name]) and RANGE not in f.metadata]
    assert not missing, f"{cls.__name__}: numeric fields without a declared range (use ranged()): {missing}"
    check_config(cls())  # the defaults lie in their ranges
