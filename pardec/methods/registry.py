"""Recipe name -> (method class, config dataclass). A new method registers itself here."""

from __future__ import annotations

import importlib

from pardec.common.errors import ConfigError

# name -> "module:MethodClass:ConfigClass"
_RECIPES = {
    "ar": "pardec.methods.ar:ARMethod:ARConfig",
    "idlm": "pardec.methods.idlm:IDLMMethod:IDLMConfig",
    "idlm_lora": "pardec.methods.idlm_lora:IDLMLoraMethod:IDLMLoraConfig",
    "jacobi_forcing": "pardec.methods.jacobi_forcing:JacobiForcingMethod:JacobiForcingConfig",
    "mdm": "pardec.methods.mdm:MDMMethod:MDMConfig",
    "refusion": "pardec.methods.refusion:ReFusionMethod:ReFusionConfig",
}


def _resolve(name: str):
    if name not in _RECIPES:
        raise ConfigError(f"config key 'recipe.name' = {name!r}; known recipes: {sorted(_RECIPES)}")
    module, method_cls, config_cls = _RECIPES[name].split(":")
    mod = importlib.import_module(module)
    return getattr(mod, method_cls), getattr(mod, config_cls)


def recipe_schema(name: str):
    return _resolve(name)[1]


def build_method(recipe_cfg, tokenizer):
    method_cls, _ = _resolve(recipe_cfg.name)
    return method_cls(recipe_cfg, tokenizer)
