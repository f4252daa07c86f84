"""Where lm-eval's Hugging Face model (``--model hf``) ends a generation, applied to a pardec decoder's output.

lm-eval's ``HFLM.generate_until`` adds the EOS token's text to the request's ``until`` strings, generates
with ``transformers`` ``generate`` under one ``MultiTokenEOSCriteria`` per stop string (it fires once the
stop string occurs in the text of the last ``len(encode(stop)) + 2`` generated tokens, special tokens
included), EOS and ``max_gen_toks``, then decodes the generated tokens without special tokens and cuts
the text before the first occurrence of each stop string (``postprocess_generated_text``).

A pardec decoder stops only at EOS ids and ``max_new_tokens``, so its output may run past a stop string.
:func:`hf_continuation` replays lm-eval's own criteria on that output token by token, keeps the tokens
up to the step where ``generate`` would have stopped, and post-processes them as lm-eval does: for the
same generated tokens the text equals HF's at batch size 1 (batched, HF stops a row only once every row of
the batch has met the same stop string, so its tokens past a special-token stop depend on the batch).
:func:`special_stop_ids` names the stop strings that are one special token (``<|im_end|>``, the EOS text): a
decoder stops at them as at EOS, since HF stops on the step that emits them too. With the EOS ids of the model's
generation config (:func:`generation_eos_ids`, where ``generate`` stops) they are the ids where HF stops without a
criterion; a chat template's end-of-turn token that is neither (validation stops there too) does not stop HF.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lm_eval.models.utils import postprocess_generated_text
from lm_eval.models.utils_hf import stop_sequences_criteria


def special_stop_ids(tokenizer, until: Sequence[str]) -> set[int]:
    """Ids of the special tokens whose text is one of the stop strings ``until``."""
    special = dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    special.update({t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special})
    return {special[s] for s in until if s in special}


def generation_eos_ids(model) -> set[int]:
    """The EOS ids of ``model``'s generation config, where ``transformers`` ``generate`` stops."""
    value = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return {value} if isinstance(value, int) else {int(v) for v in value or ()}


def hf_stop_length(tokenizer, tokens: Sequence[int], until: Sequence[str]) -> int:
    """How many of ``tokens`` ``generate`` under lm-eval's stop criteria keeps (all when none fires)."""
    if not until:
        return len(tokens)
    criteria = stop_sequences_criteria(tokenizer, list(until), initial_decoder_input_length=0, batch_size=1)
    for step in range(1, len(tokens) + 1):
        ids = torch.tensor([list(tokens[:step])], dtype=torch.long)
        if any([bool(criterion(ids, None)) for criterion in criteria]):  # a list: every criterion sees the step
            return step
    return len(tokens)


def hf_continuation(tokenizer, tokens: Sequence[int], until: Sequence[str]) -> str:
    """The text lm-eval's HF model returns for generated ``tokens`` under the stop strings ``until``
    (the EOS text already among them, as ``handle_stop_sequences`` adds it)."""
    kept = list(tokens[: hf_stop_length(tokenizer, tokens, until)])
    return postprocess_generated_text(tokenizer.decode(kept, skip_special_tokens=True), list(until), None)
