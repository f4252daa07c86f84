"""Tokenise prompt/response examples with ``datasets.map`` and apply the length policy.

Each output row has ``input_ids`` (prompt + response + EOS), ``prompt_len`` (number of prompt
tokens) and ``length``. Templates:

* ``plain``: ``prompt`` and ``response`` are tokenised separately (no special tokens) and
  concatenated, so the prompt/response boundary is exact whatever the tokenizer merges;
* ``chat``: the tokenizer's chat template; the prompt is the user turn with the generation prompt,
  the response is the rest of the full conversation's rendering (checked to be a prefix).

Length policy (``data.length_policy``) for samples longer than ``data.max_length``: ``truncate``
keeps the first ``max_length`` tokens (a sample whose prompt alone fills it is dropped: nothing to
learn), ``drop`` removes it, ``error`` raises naming the first one. Counts are logged.
"""

from __future__ import annotations

import logging

import datasets

from common.errors import DataError

log = logging.getLogger(__name__)


def format_prompt_ids(tokenizer, prompt: str, template: str) -> list[int]:
    """Prompt token ids exactly as training saw them (validation reuses this)."""
    if template == "plain":
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    ))


def _encode(tokenizer, prompt: str, response: str, template: str) -> tuple[list[int], int]:
    prompt_ids = format_prompt_ids(tokenizer, prompt, template)
    if template == "plain":
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt_ids + response_ids, len(prompt_ids)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=True, return_dict=False
    )
    if full[: len(prompt_ids)] != prompt_ids:
        raise DataError("chat template: the rendered conversation does not start with the rendered prompt; use data.template=plain")
    return list(full), len(prompt_ids)


def tokenize_dataset(raw: datasets.Dataset, tokenizer, data_cfg, split: str = "train") -> datasets.Dataset:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; every sample must end with one")
    template = data_cfg.template
    max_length = data_cfg.max_length

    def encode_batch(batch):
        ids, prompt_lens = [], []
        for prompt, response in zip(batch["prompt"], batch["response"]):
            seq, p_len = _encode(tokenizer, prompt, response, template)
            ids.append(seq)
            prompt_lens.append(p_len)
        return {"input_ids": ids, "prompt_len": prompt_lens, "length": [len(s) for s in ids]}

    keep = [c for c in raw.column_names if c in ("answer",)]
    tokenized = raw.map(
        encode_batch,
        batched=True,
        num_proc=data_cfg.num_proc if data_cfg.num_proc > 1 else None,
        remove_columns=[c for c in raw.column_names if c not in keep],
        desc=f"tokenize {split}",
    )
    return apply_length_policy(tokenized, max_length, data_cfg.length_policy, split)


def apply_length_policy(ds: datasets.Dataset, max_length: int, policy: str, split: str) -> datasets.Dataset:
    lengths = ds["length"]
    too_long = [i for i, n in enumerate(lengths) if n > max_length]
    if not too_long:
        return ds
    first = too_long[0]
    where = f"{split} sample {first} has {lengths[first]} tokens > data.max_length={max_length}"
    if policy == "error":
        raise DataError(f"{where} (data.length_policy=error; use truncate or drop)")
    if policy == "drop":
        kept = ds.select([i for i in range(len(ds)) if lengths[i] <= max_length])
        log.warning("length policy 'drop': dropped %d of %d %s samples (first: %s)", len(too_long), len(ds), split, where)
        if len(kept) == 0:
            raise DataError(f"every {split} sample is longer than data.max_length={max_length}; nothing left ({where})")
        return kept
    prompt_lens = ds["prompt_len"]
    doomed = [i for i in too_long if prompt_lens[i] >= max_length]

    def truncate(row):
        if row["length"] > max_length:
            row["input_ids"] = row["input_ids"][:max_length]
            row["length"] = max_length
        return row

    truncated = ds.map(truncate, desc=f"truncate {split}")
    if doomed:
        truncated = truncated.select([i for i in range(len(ds)) if i not in set(doomed)])
    log.warning(
        "length policy 'truncate': truncated %d of %d %s samples to %d tokens, dropped %d whose prompt alone is that long (first: %s)",
        len(too_long) - len(doomed), len(ds), split, max_length, len(doomed), where,
    )
    if len(truncated) == 0:
        raise DataError(f"every {split} prompt is longer than data.max_length={max_length}")
    return truncated
