"""Raw prompt/response examples from the configured source, as a ``datasets.Dataset``.

Every source yields at least the columns ``prompt`` and ``response`` (renamed from
``data.prompt_field`` / ``data.response_field``); the embedded synthetic source adds ``answer``.
Local files: ``.jsonl``/``.json`` (one object per line), ``.parquet``, or ``.txt`` (one response
per line, empty prompt: plain pre-training text). ``hub`` loads a named dataset with ``datasets``
(needs network or a populated HF cache; never used by the tests).

Right after loading, every source is checked (:func:`check_text_fields`): ``prompt`` and
``response`` must be strings in every row, so a missing, null or numeric field (a jsonl row
without ``response``, a parquet column of ints or lists) is named by file (or hub name and split),
row and field instead of failing inside the tokenizer. Empty strings are allowed: an empty prompt
is plain text to continue, and empty responses are counted (and, when the method trains on
responses, an all-empty training set refused) by ``pardec.data_pipelines.tokenize``. Several files of a
split are loaded one by one, so a bad row is named with its own file and its row in that file; a
JSON-lines or JSON file that does not parse is named with the line and column where it stops.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pyarrow.compute as pc

from pardec.common.errors import DataError
from pardec.data_pipelines.synthetic_gsm import generate_split, is_split_name

SPLITS = ("train", "eval")


def load_raw_split(data_cfg, split: str) -> datasets.Dataset:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if data_cfg.source == "synthetic":
        rows = generate_split(data_cfg.synthetic, "train" if split == "train" else synthetic_eval_split(data_cfg))
        ds = datasets.Dataset.from_list(rows)
        check_text_fields(ds, f"data.source=synthetic ({split})", data_cfg)
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


def synthetic_eval_split(data_cfg) -> str:
    """The generator's split a synthetic eval set is drawn from: ``data.eval_split`` = ``test`` (the
    200 held-out problems, for reported tables), ``val`` (disjoint from train and test, for choosing
    settings) or ``fresh1``, ``fresh2``, ... (disjoint from all three: new problems to check a table on)."""
    if data_cfg.eval_split == "train" or not is_split_name(data_cfg.eval_split):
        raise DataError(f"config key 'data.eval_split' = {data_cfg.eval_split!r}; with data.source=synthetic "
                        "expected test (held out, for reported results), val (for choosing settings) or "
                        "fresh<k> (fresh1, fresh2, ...: new problems, to check results on)")
    return data_cfg.eval_split


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
    parts = []
    for f in files:
        try:
            ds = datasets.load_dataset(builder, data_files=[f], split="train")
        except Exception as err:  # datasets raises many types for malformed files
            where = _json_error(Path(f)) if builder == "json" else None
            raise DataError(f"{key}: could not read {f}: {where or err}") from err
        if builder == "text":
            ds = ds.rename_column("text", "response").add_column("prompt", [""] * len(ds))
        else:
            ds = _rename_fields(ds, data_cfg, f"{key}: {f}")
        check_text_fields(ds, f"{key}: {f}", data_cfg)
        parts.append(ds)
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as err:
        columns = "; ".join(f"{f}: {dict(part.features)}" for f, part in zip(files, parts))
        raise DataError(f"{key}: the files' columns do not match ({columns}): {err}") from err


def _json_error(path: Path) -> str | None:
    """Where a JSON-lines (or ``.json``) file stops parsing, as ``line N, column C: <what>`` (1-based),
    or None when it parses (the reader failed for another reason). A ``.json`` file may also be one
    JSON document spanning many lines; it is located as such when its first line is not a JSON object."""
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
            value = json.loads(text) if text.strip() else {}
        except UnicodeDecodeError as err:
            problem = f"line {number}: not UTF-8 ({err.reason} at byte {err.start} of the line)"
        except json.JSONDecodeError as err:
            problem = f"line {number}, column {err.colno}: {err.msg}"
        else:
            if isinstance(value, dict):
                continue
            problem = f"line {number}: a JSON {type(value).__name__}, not an object"
        break
    else:
        return None
    if path.suffix.lower() != ".json" or number != 1:
        return problem
    try:  # not JSON lines from the first line on: one document
        json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return problem
    except json.JSONDecodeError as err:
        return f"line {err.lineno}, column {err.colno}: {err.msg}"
    return None


def _load_hub(data_cfg, split: str) -> datasets.Dataset:
    if not data_cfg.hub_name:
        raise DataError("config key 'data.hub_name' is required when data.source=hub")
    hub_split = data_cfg.train_split if split == "train" else data_cfg.eval_split
    ds = datasets.load_dataset(data_cfg.hub_name, data_cfg.hub_config, split=hub_split)
    where = f"data.hub_name={data_cfg.hub_name} split {hub_split!r}"
    ds = _rename_fields(ds, data_cfg, where)
    check_text_fields(ds, where, data_cfg)
    return ds


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


def check_text_fields(ds: datasets.Dataset, where: str, data_cfg) -> None:
    """Every row's ``prompt`` and ``response`` is a string (``""`` allowed); :class:`DataError`
    naming ``where`` (the file, or hub name and split), the first bad row (counting from 0 in that
    file), the field as configured and its value otherwise."""
    for column, key in (("prompt", "data.prompt_field"), ("response", "data.response_field")):
        name = getattr(data_cfg, key.split(".")[1])
        feature = ds.features[column]
        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
            values = ds.with_format("arrow")[column]
            if values.null_count == 0:
                continue
            row = pc.index(pc.is_null(values), True).as_py()
            raise DataError(
                f"{where}: row {row}: field {name!r} (config key '{key}') is missing or null; every row needs a "
                f"string {column} (an empty string is allowed)"
            )
        for row, value in enumerate(ds[column]):  # not a string column: find the first offending row
            if not isinstance(value, str):
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
                what = "missing or null" if value is None else f"{shown} (type {type(value).__name__})"
                raise DataError(
                    f"{where}: row {row}: field {name!r} (config key '{key}') is {what}, not a string; "
                    f"every row needs a string {column} (column type: {feature})"
                )
