"""The ``data`` node of the training and validation configs (``pardec/recipes/data/*.yaml``): where the
prompt/response examples come from, how they are formatted, tokenised, length-checked and packed.
Validated key by key by the Hydra schemas of ``pardec.trainers.config`` and ``pardec.inference.config``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from pardec.common.config_fields import Choice, ranged
from pardec.data_pipelines.packing import PadTo
from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig


class DataSource(Choice):
    """synthetic (embedded GSM-style generator) | files (local jsonl/json/parquet/txt) | hub"""

    synthetic = "synthetic"
    files = "files"
    hub = "hub"


class Template(Choice):
    """plain: prompt + response concatenated as is; chat: the tokenizer's chat template; auto: chat
    when the tokenizer has a chat template (a chat model), else plain
    (``pardec.data_pipelines.tokenize.resolve_template``)."""

    auto = "auto"
    plain = "plain"
    chat = "chat"


class LengthPolicy(Choice):
    """truncate | drop (counted and logged) | error (first over-long sample raises)"""

    truncate = "truncate"
    drop = "drop"
    error = "error"


@dataclass
class DataConfig:
    source: DataSource = DataSource.synthetic
    train_files: List[str] = field(default_factory=list)
    eval_files: List[str] = field(default_factory=list)
    hub_name: Optional[str] = None
    hub_config: Optional[str] = None
    train_split: str = "train"
    eval_split: str = "test"
    prompt_field: str = "prompt"
    response_field: str = "response"
    template: Template = Template.auto
    max_length: int = ranged(512, ge=1)
    length_policy: LengthPolicy = LengthPolicy.truncate
    packing: bool = True
    # Row length when packing; null = max_length.
    pack_length: Optional[int] = ranged(None, ge=1)
    # How long a collated batch's rows are: pack_length (static shapes, for compiled kernels and CUDA
    # graphs) or longest (the micro-batch's longest row: no forward over unused slots, the CPU choice).
    # I-DLM, Jacobi Forcing, ReFusion and MDM read it; AR rows are always padded to the longest.
    pad_to: PadTo = PadTo.pack_length
    # Largest fraction of a split's tokens that may be the tokenizer's unknown token (a tokenizer
    # that does not cover the text, e.g. non-ASCII text with a word-level vocabulary); above it
    # tokenisation fails naming the split, the rate and a row. null = no check (the rate is still
    # logged). Not counted for tokenizers without an unknown token (byte-level BPE).
    max_unk_rate: Optional[float] = ranged(0.01, ge=0, le=1)
    num_proc: int = ranged(1, ge=1)
    # The first N rows of a split; null = all.
    max_train_samples: Optional[int] = ranged(None, ge=1)
    max_eval_samples: Optional[int] = ranged(None, ge=1)
    synthetic: SyntheticGSMConfig = field(default_factory=SyntheticGSMConfig)
