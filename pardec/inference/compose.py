"""The validation config outside a Hydra application: what ``pardec-validate <overrides>`` would run with.

:func:`compose_validate_config` composes ``pardec/recipes/validate.yaml`` with Hydra's compose API (the
same recipes, the same ``validate_schema`` and the same
:func:`pardec.inference.config.validate_validate_config` checks as the CLI), so a caller that is not a
Hydra CLI (the lm-eval model in ``pardec.evaluation``) gets exactly validation's defaults for
``decoder=<choice>`` and ``decoder.<key>=<value>``. A composition error (unknown key, unknown decoder
choice) is a :class:`pardec.common.errors.ConfigError` carrying Hydra's message.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig

from pardec.common.errors import ConfigError
from pardec.inference.config import ValidateConfig, validate_validate_config


def register_validate_schema() -> None:
    """Make ``validate_schema`` (the first default of pardec/recipes/validate.yaml) known to Hydra."""
    ConfigStore.instance().store(name="validate_schema", node=ValidateConfig)


def compose_validate_config(overrides: Sequence[str]) -> DictConfig:
    """The validated config of ``pardec-validate`` with ``overrides`` (Hydra override strings)."""
    register_validate_schema()
    try:
        with initialize_config_module("pardec.recipes", version_base="1.3"):
            cfg = compose("validate", overrides=list(overrides))
    except HydraException as err:
        raise ConfigError(f"invalid validation config {list(overrides)}: {err}") from None
    return validate_validate_config(cfg)
