"""What an export records for the decoders: one typed record, written once, read and checked once.

A recipe's export stores a :class:`CheckpointMetadata` as a plain dict under ``config.json``'s
``"pardec"`` key (``pardec.common.constants.METADATA_KEY``); transformers keeps unknown config keys, so
the record travels with ``save_pretrained``/``from_pretrained``. The trainer writes it at export
(:meth:`CheckpointMetadata.write_to`, from ``Method.export_metadata``); everything that reads it
goes through :meth:`CheckpointMetadata.of_model` or :meth:`CheckpointMetadata.read`, which reject an
unknown key, a wrong type or an out-of-range value with a :class:`pardec.common.errors.CheckpointError`
naming the file and the key. Decoders take their defaults from it (ISD stride, Jacobi block size,
ReFusion slot size, the MDM's attention and shift convention) instead of guessing.

Provenance fields (``base_model``, ``command``, ``license``, ``source``) say where the weights came from;
the model card (:mod:`pardec.common.model_card`) shows them. An export inherits them from the checkpoint
it was trained from, and the trainer overwrites ``base_model`` and ``command`` with its own.

A plain AR checkpoint (never converted) has no record: every field is ``None``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from pardec.common.constants import METADATA_KEY
from pardec.common.errors import CheckpointError

ATTENTION_KINDS = ("causal", "bidirectional", "block")

# What a checkpoint is to the decoders (CheckpointMetadata.kind), from its attention, logit shift and
# <|mask|>; each decoder declares the kinds it decodes (pardec.inference.decoders.base.Decoder.checkpoint_kinds).
AR = "ar"  # causal attention, next-token logits, no <|mask|>: a base LM, an AR or Jacobi Forcing export
MASKED_AR = "masked-ar"  # causal attention with a recorded <|mask|>: I-DLM and ReFusion exports
MDM_BIDIRECTIONAL = "mdm-bidirectional"  # bidirectional attention, shifted logits, <|mask|>: recipe=mdm
MDM_BLOCK = "mdm-block"  # the same with block-causal attention
CHECKPOINT_KINDS = (AR, MASKED_AR, MDM_BIDIRECTIONAL, MDM_BLOCK)
# What ``source`` may record about an imported checkpoint (pardec.cli.import_model writes it).
SOURCE_KEYS = ("package", "version", "file", "wheel_sha256", "gguf_sha256", "conversion")


def model_where(model) -> str:
    """Where a loaded model's record comes from, for error messages: ``config.json of <its directory>``."""
    return f"config.json of {getattr(getattr(model, 'config', None), '_name_or_path', '') or 'the model'}"


@dataclass(frozen=True)
class CheckpointMetadata:
    # The recipe that made the export (ar, idlm, idlm_lora, jacobi_forcing, refusion, mdm, ...).
    recipe: Optional[str] = None
    # The tokenizer's <|mask|> id (recipes that add it); checked against the tokenizer at load.
    mask_token_id: Optional[int] = None
    # I-DLM: the ISD stride N the export was trained for (x_t blocks of N - 1).
    isd_stride: Optional[int] = None
    # Jacobi Forcing: the block size n of the last training round.
    jacobi_block_size: Optional[int] = None
    # R-ISD: the gated-LoRA adapter's directory, relative to the export.
    gated_lora_adapter: Optional[str] = None
    # ReFusion: the slot size k decoding uses by default.
    slot_size: Optional[int] = None
    # MDM: attention of the converted model: causal | bidirectional | block ...
    attention: Optional[str] = None
    # ... the block size when attention is "block" ...
    attention_block_size: Optional[int] = None
    # ... and the logit-shift convention: True = the output at position i predicts token i + 1.
    logit_shift: Optional[bool] = None
    # Provenance: the checkpoint the export was made from (a Hugging Face Hub id or a directory) ...
    base_model: Optional[str] = None
    # ... the command that made it (``pardec-train experiment=...``, ``pardec-import ...``) ...
    command: Optional[str] = None
    # ... the weights' license (a Hub license id such as apache-2.0), carried over from the base ...
    license: Optional[str] = None
    # ... and for an imported checkpoint where its weights came from: SOURCE_KEYS -> strings.
    source: Optional[Dict[str, str]] = None

    # -- reading -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, where: str) -> "CheckpointMetadata":
        """Validate ``raw`` (the ``pardec`` dict of ``where``'s config.json); ``None`` = no record."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise CheckpointError(f"{where}: '{METADATA_KEY}' must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CheckpointError(
                f"{where}: unknown key(s) {[f'{METADATA_KEY}.{k}' for k in unknown]} in the checkpoint metadata; "
                f"known keys: {sorted(known)}"
            )
        record = cls(**{k: v for k, v in raw.items() if v is not None})
        record._check(where)
        return record

    @classmethod
    def of_model(cls, model) -> "CheckpointMetadata":
        """The record of a loaded model (``model.config.pardec``)."""
        return cls.from_dict(getattr(getattr(model, "config", None), METADATA_KEY, None), model_where(model))

    @classmethod
    def read(cls, export_dir: str | Path) -> "CheckpointMetadata":
        """The record in ``export_dir/config.json`` without loading the model."""
        path = Path(export_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"no config.json in checkpoint directory {export_dir}") from None
        except json.JSONDecodeError as err:
            raise CheckpointError(f"corrupt {path}: {err}") from err
        return cls.from_dict(config.get(METADATA_KEY), str(path))

    # -- writing -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (what ``config.json`` stores)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def updated(self, **values: Any) -> "CheckpointMetadata":
        """A copy with ``values`` set (``None`` leaves a field as it is), validated."""
        merged = {**self.to_dict(), **{k: v for k, v in values.items() if v is not None}}
        return CheckpointMetadata.from_dict(merged, "checkpoint metadata being written")

    def write_to(self, model) -> None:
        """Store the record in ``model.config`` (``save_pretrained`` then writes it)."""
        setattr(model.config, METADATA_KEY, self.to_dict())

    # -- what it is, for the decoders ----------------------------------------------------------

    @property
    def kind(self) -> str:
        """One of :data:`CHECKPOINT_KINDS`, or ``other`` (e.g. bidirectional without the logit shift),
        which no decoder here decodes."""
        if self.attention in (None, "causal"):
            return AR if self.mask_token_id is None else MASKED_AR
        if self.logit_shift and self.mask_token_id is not None:
            return MDM_BIDIRECTIONAL if self.attention == "bidirectional" else MDM_BLOCK
        return "other"

    def describe_kind(self) -> str:
        """The kind and the fields it is read from, for error messages."""
        return (f"{self.kind} ({METADATA_KEY}.recipe={self.recipe!r}, attention={self.attention!r}, "
                f"logit_shift={self.logit_shift!r}, mask_token_id={self.mask_token_id!r})")

    # -- checks --------------------------------------------------------------------------------

    def _check(self, where: str) -> None:
        def bad(key: str, expected: str) -> CheckpointError:
            return CheckpointError(f"{where}: '{METADATA_KEY}.{key}' = {getattr(self, key)!r}; expected {expected}")

        for key in ("recipe", "gated_lora_adapter", "attention", "base_model", "command", "license"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise bad(key, "a string")
        minimum = {"mask_token_id": 0, "isd_stride": 2, "jacobi_block_size": 1, "slot_size": 1,
                   "attention_block_size": 1}
        for key, low in minimum.items():
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise bad(key, f"an integer >= {low}")
        if self.logit_shift is not None and not isinstance(self.logit_shift, bool):
            raise bad("logit_shift", "true or false")
        if self.source is not None and (
            not isinstance(self.source, Mapping)
            or not set(self.source) <= set(SOURCE_KEYS)
            or not all(isinstance(v, str) for v in self.source.values())
        ):
            raise bad("source", f"a mapping of {list(SOURCE_KEYS)} to strings")
        if self.attention is not None and self.attention not in ATTENTION_KINDS:
            raise bad("attention", f"one of {ATTENTION_KINDS}")
        if self.attention == "block" and self.attention_block_size is None:
            raise CheckpointError(f"{where}: '{METADATA_KEY}.attention' is 'block' but no attention_block_size "
                                  "is recorded")
