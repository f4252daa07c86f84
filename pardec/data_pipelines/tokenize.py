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

Checks on the split's content (:func:`check_responses`, :func:`check_unknown_rate`):

* empty responses (whitespace only): counted and logged with the first row; when *every* response
  is empty and the method's targets are the responses (``require_responses``: AR on responses,
  I-DLM), the split is refused, since it would train the model to answer with EOS alone. Jacobi
  Forcing (targets are its own trajectories) and AR with ``train_on=all`` (prompts are targets)
  only get the warning;
* the unknown-token rate (tokens equal to the tokenizer's unk id, over all tokens of the split,
  before the length policy) is logged per split, and above ``data.max_unk_rate`` the split is
  refused naming the rate, a row and the unknown text. Tokenizers without an unk token (byte-level
  BPE) are not counted. ``pardec/cli/validate.py`` checks its eval split's prompts the same way
  (:func:`check_prompt_unknown_rate`).
"""

from __future__ import annotations

import logging

import datasets
import pyarrow.compute as pc

from pardec.common.errors import DataError

log = logging.getLogger(__name__)


def end_of_turn_token_id(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with (``<|im_end|>`` for
    ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma), read off the template itself:
    a one-turn conversation with a marker answer is rendered and the first special token after the
    marker is the end of turn. None without a chat template or when the turn ends with no special
    token. Chat models stop there, which is not always their EOS (Llama 3's is ``<|end_of_text|>``)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "pardec end-of-turn probe"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    after = rendered[rendered.rfind(marker) + len(marker):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {
        i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False)
    }
    return next((i for i in ids if i in special), None)


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Where an answer ends: the tokenizer's EOS, the chat template's end-of-turn token
    (:func:`end_of_turn_token_id`) and the EOS ids of the model's generation config, when present.
    Every decoder and the Jacobi trajectory collection stop at any of them."""
    ids = set()
    for value in (tokenizer.eos_token_id, end_of_turn_token_id(tokenizer),
                  getattr(generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def resolve_template(tokenizer, template: str) -> str:
    """``data.template`` for this tokenizer: ``auto`` is ``chat`` when it has a chat template (chat
    models are trained and prompted through it), else ``plain``; ``chat`` without a chat template is
    refused naming the key."""
    if template == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError("data.template=chat but the tokenizer has no chat template; set data.template=plain "
                        "(or auto, which picks plain for it)")
    return str(template)


def format_prompt_ids(tokenizer, prompt: str, template: str) -> list[int]:
    """Prompt token ids exactly as training saw them (validation reuses this)."""
    template = resolve_template(tokenizer, template)
    if template == "plain":
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    ))


def encode_example(tokenizer, prompt: str, response: str, template: str) -> tuple[list[int], int]:
    """(prompt + response token ids, the prompt's length) as training sees one example under ``template``
    (``plain``: the response then EOS; ``chat``: the rendered conversation, whose tail after the end-of-turn
    token is the template's own)."""
    template = resolve_template(tokenizer, template)
    prompt_ids = format_prompt_ids(tokenizer, prompt, template)
    if template == "plain":
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt_ids + response_ids, len(prompt_ids)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
        tokenize=True, return_dict=False
    )
    if full[: len(prompt_ids)] != prompt_ids:
        raise DataError("chat template: the rendered conversation does not start with the rendered prompt; "
                        "use data.template=plain")
    return list(full), len(prompt_ids)


def tokenize_dataset(
    raw: datasets.Dataset, tokenizer, data_cfg, split: str = "train", require_responses: bool = True
) -> datasets.Dataset:
    """``require_responses``: the method's targets are the responses (see :func:`check_responses`)."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; every sample must end with one")
    check_responses(raw, data_cfg, split, require_responses)
    template = resolve_template(tokenizer, data_cfg.template)
    max_length = data_cfg.max_length

    def encode_batch(batch):
        ids, prompt_lens = [], []
        for prompt, response in zip(batch["prompt"], batch["response"]):
            seq, p_len = encode_example(tokenizer, prompt, response, template)
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
    check_unknown_rate(tokenized, raw, tokenizer, data_cfg, split)
    return apply_length_policy(tokenized, max_length, data_cfg.length_policy, split)


def check_responses(raw: datasets.Dataset, data_cfg, split: str, require_responses: bool) -> None:
    """Count empty (whitespace-only) responses: a warning naming the count and the first row; a
    :class:`DataError` when every response is empty and ``require_responses``."""
    empty = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(raw.with_format("arrow")["response"])), 0)
    n_empty = pc.sum(empty).as_py() or 0
    if n_empty == 0:
        return
    first = pc.index(empty, True).as_py()
    field = f"config key 'data.response_field' = {data_cfg.response_field!r}"
    if n_empty == len(raw) and require_responses:
        raise DataError(
            f"every {split} response is empty ({n_empty} rows, {field}): training would teach the model to answer "
            "with EOS alone; check data.response_field (or use recipe.train_on=all for prompt-only text)"
        )
    log.warning("%d of %d %s responses are empty (first: row %d; %s); they train on EOS alone",
                n_empty, len(raw), split, first, field)


def check_unknown_rate(tokenized: datasets.Dataset, raw: datasets.Dataset, tokenizer, data_cfg, split: str):
    """The fraction of the split's tokens that are the tokenizer's unknown token, logged; a
    :class:`DataError` above ``data.max_unk_rate`` naming the split, the rate, the first row with
    one and the text it came from. None (nothing counted) when the tokenizer has no unk token."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return None
    max_rate = data_cfg.max_unk_rate
    ids = tokenized.with_format("arrow")["input_ids"].combine_chunks()  # one list per row
    hits = pc.equal(ids.flatten(), unk)
    n_unk, total = pc.sum(hits).as_py() or 0, len(hits)
    rate = n_unk / total if total else 0.0
    log.info("%s: %d of %d tokens (%.2f%%) are the unknown token %r", split, n_unk, total, 100 * rate,
             tokenizer.unk_token)
    if n_unk == 0:
        return rate
    row = pc.list_parent_indices(ids)[pc.index(hits, True).as_py()].as_py()
    where = f"first in row {row}: {_unknown_text(tokenizer, raw[row], unk)}"
    if max_rate is not None and rate > max_rate:
        raise DataError(
            f"{split}: {100 * rate:.2f}% of the tokens ({n_unk} of {total}) are the tokenizer's unknown token "
            f"{tokenizer.unk_token!r} ({where}) > data.max_unk_rate={max_rate}: the tokenizer does not cover this "
            "text (use the model's own tokenizer), or raise data.max_unk_rate (null = no check)"
        )
    log.warning("%s: %d unknown tokens %r (%s); data.max_unk_rate=%s", split, n_unk, tokenizer.unk_token, where,
                max_rate)
    return rate


def check_prompt_unknown_rate(raw: datasets.Dataset, tokenizer, data_cfg, split: str = "eval"):
    """:func:`check_unknown_rate` of the prompts alone, formatted as decoding sees them (an eval
    split: only its prompts are encoded). Skipped (None) for ``chat`` without a chat template,
    which evaluation refuses by name."""
    if data_cfg.template == "chat" and not tokenizer.chat_template:
        return None
    prompts = raw.map(
        lambda row: {"input_ids": format_prompt_ids(tokenizer, row["prompt"], data_cfg.template)},
        remove_columns=raw.column_names,
        desc=f"encode {split} prompts",
    )
    return check_unknown_rate(prompts, raw, tokenizer, data_cfg, split)


def _unknown_text(tokenizer, row, unk: int) -> str:
    """The first piece of ``row``'s text that encodes to ``unk`` (fast tokenizers), else the row's text."""
    def short(text: str) -> str:
        return repr(text if len(text) <= 60 else text[:57] + "...")

    for field in ("prompt", "response"):
        text = row[field]
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):
            break
        for token, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
            if token == unk:
                return f"{text[start:end]!r} in the {field} {short(text)}"
    return f"prompt {short(row['prompt'])}, response {short(row['response'])}"


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
        log.warning("length policy 'drop': dropped %d of %d %s samples (first: %s)", len(too_long), len(ds), split,
                    where)
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
        "length policy 'truncate': truncated %d of %d %s samples to %d tokens, dropped %d whose prompt alone is "
        "that long (first: %s)",
        len(too_long) - len(doomed), len(ds), split, max_length, len(doomed), where,
    )
    if len(truncated) == 0:
        raise DataError(f"every {split} prompt is longer than data.max_length={max_length}")
    return truncated
