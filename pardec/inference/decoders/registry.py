"""Decoder name -> (decoder class, config dataclass). A new decoder (isd, jacobi, cover, ...)
registers itself here with one line; its config dataclass subclasses ``DecoderConfig`` so the
Hydra ``decoder`` group is validated key by key."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pardec.common.config_fields import check_config
from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.inference.decoders.base import Decoder, DecoderConfig

# name -> "module:DecoderClass:ConfigClass"
_DECODERS = {
    "ar": "pardec.inference.decoders.ar:ARDecoder:ARDecoderConfig",
    "jacobi": "pardec.inference.decoders.jacobi:JacobiDecoder:JacobiDecoderConfig",
    "multiblock": "pardec.inference.decoders.multiblock:MultiBlockDecoder:MultiBlockDecoderConfig",
    "isd": "pardec.inference.decoders.isd:ISDDecoder:ISDDecoderConfig",
    "mdm_lowconf": "pardec.inference.decoders.mdm_lowconf:MDMLowConfDecoder:MDMLowConfConfig",
    "mdm_threshold": "pardec.inference.decoders.mdm_threshold:MDMThresholdDecoder:MDMThresholdConfig",
    "mdm_guided": "pardec.inference.decoders.mdm_guided:MDMGuidedDecoder:MDMGuidedConfig",
    "cover": "pardec.inference.decoders.cover:CoverDecoder:CoverConfig",
    "wino": "pardec.inference.decoders.wino:WinoDecoder:WinoConfig",
    "saber": "pardec.inference.decoders.saber:SaberDecoder:SaberConfig",
    "refusion": "pardec.inference.decoders.refusion:ReFusionDecoder:ReFusionDecoderConfig",
}


def _resolve(name: str) -> tuple[type[Decoder], type[DecoderConfig]]:
    if name not in _DECODERS:
        raise ConfigError(f"config key 'decoder.name' = {name!r}; known decoders: {sorted(_DECODERS)}")
    module, decoder_cls, config_cls = _DECODERS[name].split(":")
    mod = importlib.import_module(module)
    return getattr(mod, decoder_cls), getattr(mod, config_cls)


def decoder_config(raw: Mapping[str, Any] | DictConfig | DecoderConfig) -> DecoderConfig:
    """Validate a decoder config (mapping, DictConfig or dataclass) into its dataclass.

    An unknown or mistyped key, a value outside its declared range or choices raises
    :class:`ConfigError` naming ``decoder.<key>``.
    """
    if is_dataclass(raw):
        check_config(raw, "decoder")
        return raw
    data = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else dict(raw)
    if "name" not in data:
        raise ConfigError("config key 'decoder.name' is missing: choose a decoder, e.g. decoder=ar_greedy")
    _, config_cls = _resolve(data["name"])
    try:
        node = OmegaConf.merge(OmegaConf.structured(config_cls), data)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"invalid config key 'decoder.{key}': {str(err).splitlines()[0]}") from None
    cfg = OmegaConf.to_object(node)
    check_config(cfg, "decoder")
    return cfg


def build_decoder(cfg: Mapping[str, Any] | DictConfig | DecoderConfig, tokenizer) -> Decoder:
    cfg = decoder_config(cfg)
    decoder_cls, _ = _resolve(cfg.name)
    return decoder_cls(cfg, tokenizer)


def auxiliary_checkpoints(cfg: Mapping[str, Any] | DictConfig | DecoderConfig) -> dict[str, str]:
    """``{config field: export directory}`` of the auxiliary models a decoder config names
    (validation loads each once and passes them to ``evaluate(..., auxiliary=...)``)."""
    cfg = decoder_config(cfg)
    decoder_cls, _ = _resolve(cfg.name)
    return decoder_cls.auxiliary_checkpoints(cfg)


def check_checkpoint_kind(name: str, metadata: CheckpointMetadata, where: str) -> None:
    """Refuse, before any decoding, to run decoder ``name`` on a checkpoint whose kind
    (:attr:`CheckpointMetadata.kind`, read from ``where``) is not one it declares
    (``Decoder.checkpoint_kinds``): :class:`CheckpointError` naming both kinds and the decoders that
    decode this one. The one place every decoder's compatibility is checked."""
    decoder_cls, _ = _resolve(name)
    if metadata.kind in decoder_cls.checkpoint_kinds:
        return
    fits = sorted(n for n in _DECODERS if metadata.kind in _resolve(n)[0].checkpoint_kinds)
    raise CheckpointError(
        f"decoder {name!r} decodes checkpoints of kind {' or '.join(decoder_cls.checkpoint_kinds)}, but {where} is a "
        f"checkpoint of kind {metadata.describe_kind()}: "
        + (f"decode it with {', '.join(fits)}" if fits else "no decoder here decodes that kind"))
