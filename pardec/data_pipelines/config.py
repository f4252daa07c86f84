"""The ``data`` node of the training and validation configs (``pardec/recipes/data/*.yaml``): where the
prompt/response examples come from, how they are formatted, tokenised, length-checked and packed.
Validated key by key by the Hydra schemas of ``pardec.trainers.config`` and ``pardec.inference.config``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig


@dataclass
class DataConfig:
    # synthetic (embedded GSM-style generator) | files (local jsonl/json/parquet/txt) | hub
    source: str = "synthetic"
    train_files: List[str] = field(default_factory=list)
    eval_files: List[str] = field(default_factory=list)
    hub_name: Optional[str] = None
    hub_config: Optional[str] = None
    train_split: str = "train"
    eval_split: str = "test"
    prompt_field: str = "prompt"
    response_field: str = "response"
    # plain: prompt + response concatenated as is; chat: the tokenizer's chat template.
    template: str = "plain"
    max_length: int = 512
    # truncate | drop (counted and logged) | error (first over-long sample raises)
    length_policy: str = "truncate"
    packing: bool = True
    # Row length when packing; null = max_length.
    pack_length: Optional[int] = None
    # Largest fraction of a split's tokens that may be the tokenizer's unknown token (a tokenizer
    # that does not cover the text, e.g. non-ASCII text with a word-level vocabulary); above it
    # tokenisation fails naming the split, the rate and a row. null = no check (the rate is still
    # logged). Not counted for tokenizers without an unknown token (byte-level BPE).
    max_unk_rate: Optional[float] = 0.01
    num_proc: int = 1
    max_train_samples: Optional[int] = None
    max_eval_samples: Optional[int] = None
    synthetic: SyntheticGSMConfig = field(default_factory=SyntheticGSMConfig)
