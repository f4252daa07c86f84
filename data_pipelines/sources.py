"""Raw prompt/response examples from the configured source, as a ``datasets.Dataset``.

Every source yields at least the columns ``prompt`` and ``response`` (renamed from
``data.prompt_field`` / ``data.response_field``); the embedded synthetic source adds ``answer``.
Local files: ``.jsonl``/``.json`` (one object per line), ``.parquet``, or ``.txt`` (one response
per line, empty prompt: plain pre-training text). ``hub`` loads a named dataset with ``datasets``
(needs network or a populated HF cache; never used by the tests).
"""

from __future__ import annotations

import os
from pathlib import Path

import datasets

from common.errors import DataError
from data_pipelines.synthetic_gsm import generate_split

SPLITS = ("train", "eval")




def load_raw_split(data_cfg, split: str) -> datasets.Dataset:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if data_cfg.source == "synthetic":
        rows = generate_split(data_cfg.synthetic, "train" if split == "train" else "test")
        ds = datasets.Dataset.from_list(rows)
    elif data_cfg.source == "files":
        ds = _load_files(data_cfg, split)
    elif data_cfg.source == "hub":
        ds = _load_hub(data_cfg, split)
    else:
        raise DataError(f"config key 'data.source' = {data_cfg.source!r}; expected synthetic, files or hub")
    limit = data_cfg.max_train_samples if split == "train" else data_cfg.max_eval_samples
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    if len(ds) == 0:
        raise DataError(f"the {split} dataset is empty (source={data_cfg.source!r}{_where(data_cfg, split)})")
    return ds


def _where(data_cfg, split: str) -> str:
    if data_cfg.source == "files":
        files = data_cfg.train_files if split == "train" else data_cfg.eval_files
        return f", files={list(files)}"
    if data_cfg.source == "hub":
        return f", hub_name={data_cfg.hub_name!r}"
    return ""


def _load_files(data_cfg, split: str) -> datasets.Dataset:
    key = "data.train_files" if split == "train" else "data.eval_files"
    files = list(data_cfg.train_files if split == "train" else data_cfg.eval_files)
    if not files:
        raise DataError(f"config key '{key}' is empty: list the {split} files (jsonl, json, parquet or txt)")
    suffixes = set()
    for f in files:
        if not Path(f).is_file():
            raise DataError(f"{key}: file not found: {f} (cwd: {os.getcwd()})")
        if Path(f).stat().st_size == 0:
            raise DataError(f"{key}: file is empty: {f}")
        suffixes.add(Path(f).suffix.lower())
    if len(suffixes) != 1:
        raise DataError(f"{key}: mixed file types {sorted(suffixes)}; use one format per split")
    suffix = suffixes.pop()
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}.get(suffix)
    if builder is None:
        raise DataError(f"{key}: unsupported file type {suffix!r} ({files[0]}); use .jsonl, .json, .parquet or .txt")
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as err:  # datasets raises many types for malformed files
        raise DataError(f"{key}: could not read {files}: {err}") from err
    if builder == "text":
        ds = ds.rename_column("text", "response").add_column("prompt", [""] * len(ds))
        return ds
    return _rename_fields(ds, data_cfg, key)


def _load_hub(data_cfg, split: str) -> datasets.Dataset:
    if not data_cfg.hub_name:
        raise DataError("config key 'data.hub_name' is required when data.source=hub")
    hub_split = data_cfg.train_split if split == "train" else data_cfg.eval_split
    ds = datasets.load_dataset(data_cfg.hub_name, data_cfg.hub_config, split=hub_split)
    return _rename_fields(ds, data_cfg, f"data.hub_name={data_cfg.hub_name}")


def _rename_fields(ds: datasets.Dataset, data_cfg, where: str) -> datasets.Dataset:
    for field_key, target in (("prompt_field", "prompt"), ("response_field", "response")):
        name = getattr(data_cfg, field_key)
        if name not in ds.column_names:
            raise DataError(
                f"{where}: column {name!r} (config key 'data.{field_key}') not found; columns: {ds.column_names}"
            )
        if name != target:
            if target in ds.column_names:
                ds = ds.remove_columns(target)
            ds = ds.rename_column(name, target)
    return ds
