"""Greedy in-order packing of variable-length samples into rows, and padding collation.

``pack_dataset`` concatenates the per-token columns of consecutive samples into rows of at most
``pack_length`` tokens (a sample never straddles two rows) and adds per-token ``segment_ids``
(0, 1, ... per sample within the row) and ``position_ids`` (restarting at 0 per sample, unless
the samples already carry ``position_ids``, e.g. I-DLM's duplicated ``[x_t | x_0]``). Packing runs
as a batched ``datasets.map`` (cached with the dataset), so rows never mix samples from different
map batches; the waste this costs is one partial row per 1000 samples.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import datasets
import torch

from pardec.common.config_fields import Choice
from pardec.common.errors import DataError

PAD_SEGMENT = -1


class PadTo(Choice):
    """How long a collated batch's rows are (``data.pad_to``).

    pack_length: every row is padded to ``data.pack_length`` (static shapes: one compiled
    FlexAttention kernel, one CUDA graph) | longest: to the longest row of the micro-batch, so no
    forward computes a slot that no row uses (the choice on a CPU, where every slot costs; a
    Jacobi Forcing sample on SmolLM2 takes about 163 of 512 slots). The losses are the same either
    way: padding is attended by nothing and supervised nowhere (tested per recipe)."""

    pack_length = "pack_length"
    longest = "longest"


def padded_length(rows: Sequence[Sequence[int]], lengths: Sequence[int], pack_length: int, pad_to: str) -> int:
    """The row length s of a batch: ``rows`` are the sample indices per row (``greedy_pack``) and
    ``lengths`` the slots each sample takes."""
    if PadTo(pad_to) is PadTo.pack_length:
        return pack_length
    return max(sum(lengths[i] for i in row) for row in rows)


def pack_dataset(ds: datasets.Dataset, pack_length: int, token_columns: Sequence[str],
                 batch_size: int = 1000) -> datasets.Dataset:
    longest = max(ds["length"]) if len(ds) else 0
    if longest > pack_length:
        raise DataError(f"a sample has {longest} tokens > pack length {pack_length} (config key 'data.pack_length'); "
                        "truncate or drop first")
    has_positions = "position_ids" in ds.column_names

    def pack_batch(batch):
        rows: dict[str, list] = {c: [] for c in (*token_columns, "position_ids", "segment_ids", "length")}
        current: dict[str, list] | None = None
        n_batch = len(batch[token_columns[0]])
        for i in range(n_batch):
            n = len(batch[token_columns[0]][i])
            if current is None or len(current["segment_ids"]) + n > pack_length:
                if current is not None:
                    _flush(rows, current)
                current = {c: [] for c in (*token_columns, "position_ids", "segment_ids")}
                segment = 0
            for c in token_columns:
                current[c].extend(batch[c][i])
            current["position_ids"].extend(batch["position_ids"][i] if has_positions else range(n))
            current["segment_ids"].extend([segment] * n)
            segment += 1
        if current is not None:
            _flush(rows, current)
        return rows

    return ds.map(pack_batch, batched=True, batch_size=batch_size, remove_columns=ds.column_names, desc="pack")


def _flush(rows: dict[str, list], current: dict[str, list]) -> None:
    for c, values in current.items():
        rows[c].append(values)
    rows["length"].append(len(current["segment_ids"]))


def single_sample_rows(ds: datasets.Dataset, token_columns: Sequence[str]) -> datasets.Dataset:
    """No packing: one sample per row, in the same column layout as ``pack_dataset``."""

    def one(row):
        n = len(row[token_columns[0]])
        out = {c: row[c] for c in token_columns}
        out["position_ids"] = row["position_ids"] if "position_ids" in row else list(range(n))
        out["segment_ids"] = [0] * n
        out["length"] = n
        return out

    return ds.map(one, remove_columns=[c for c in ds.column_names if c not in token_columns], desc="rows")


def greedy_pack(lengths: Sequence[int], pack_length: int) -> list[list[int]]:
    """Sample indices per row: fill rows in order, start a new row when the next sample does not fit.

    ``lengths`` are slot counts (2L per I-DLM sample, prompt + 2 x blocks x n per Jacobi Forcing
    sample, ...); a sample longer than ``pack_length`` is an error.
    """
    rows: list[list[int]] = []
    used = pack_length
    for i, n in enumerate(lengths):
        if n > pack_length:
            raise ValueError(f"sample {i} needs {n} slots > pack_length={pack_length}")
        if used + n > pack_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def pad_rows(
    rows: Sequence[Mapping[str, Sequence[int] | torch.Tensor]], pad_values: Mapping[str, int], length: int | None = None
) -> dict[str, torch.Tensor]:
    """Right-pad each column of ``pad_values`` to ``length`` (default: the longest row) with its pad
    value, and stack. ``rows``: per row, ``{column: 1-D ids (list or tensor)}``. Returns
    ``{column: [r, length]}`` long tensors."""
    first = next(iter(pad_values))
    target = length if length is not None else max(len(row[first]) for row in rows)
    out = {}
    for column, pad in pad_values.items():
        padded = []
        for row in rows:
            values = torch.as_tensor(row[column], dtype=torch.long)  # [n]
            padded.append(torch.cat([values, torch.full((target - values.numel(),), pad, dtype=torch.long)]))
        out[column] = torch.stack(padded)  # [r, target]
    return out


def checked_sample(index: int, sample: Mapping[str, Any], mask_token_id: int) -> tuple[torch.Tensor, int]:
    """``(input_ids [l], prompt_len)`` of a tokenised sample that a masked recipe's batch builder
    (I-DLM, ReFusion, MDM) takes: non-empty 1-D ids, ``0 <= prompt_len <= l``, and no ``<|mask|>``
    already in the data (it would be read as a masked slot). Errors name the sample's index."""
    ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)
    prompt_len = int(sample["prompt_len"])
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"sample {index}: input_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    if not 0 <= prompt_len <= ids.numel():
        raise ValueError(f"sample {index}: prompt_len={prompt_len} outside [0, {ids.numel()}] (len(input_ids))")
    if (ids == mask_token_id).any():
        pos = int((ids == mask_token_id).nonzero()[0])
        raise ValueError(f"sample {index}: input_ids contain the mask token id {mask_token_id} at position {pos}")
    return ids, prompt_len
