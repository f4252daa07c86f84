"""pardec.benchmarks.mdm_teacher_forced: the batched teacher-forced guesses against one forward per prefix
with a mask built by a loop, and the scoring on a scripted guess."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from pardec.benchmarks.mdm_teacher_forced import ar_guesses, mdm_guesses, prompt_and_answer, score
from pardec.data_pipelines.config import DataConfig
from pardec.data_pipelines.synthetic_tokenizer import build_synthetic_tokenizer
from tests.conftest import EVAL_ROWS, chat_bpe_tokenizer, tiny_model, tiny_tokenizer

torch.set_num_threads(1)

VOCAB, MASK = 40, 39
PROMPT, ANSWER, GEN_LENGTH = [3, 4, 5], [6, 7, 8, 9, 0], 7


def mdm(attention: str, block: int | None):
    model = tiny_model(VOCAB, "qwen3", seed=1)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 60.0)  # spread the argmaxes
    model.config.tie_word_embeddings = False
    model.config.pardec = {"recipe": "mdm", "attention": attention, "logit_shift": True, "mask_token_id": MASK,
                           **({"attention_block_size": block} if block else {})}
    return model.eval()


def loop_mask(attention: str, block: int | None, p_len: int, total: int) -> torch.Tensor:
    """Additive [1, 1, n, n] mask from a loop over (q, kv): all pairs, or block(kv) <= block(q)."""
    def block_of(i: int) -> int:
        return 0 if i < p_len else 1 + (i - p_len) // block

    allowed = torch.tensor([[attention == "bidirectional" or block_of(kv) <= block_of(q) for kv in range(total)]
                            for q in range(total)])
    return torch.zeros(total, total).masked_fill(~allowed, float("-inf"))[None, None]


@pytest.mark.parametrize("attention,block", [("bidirectional", None), ("block", 3)])
def test_mdm_guesses_equal_one_forward_per_prefix(attention, block):
    model = mdm(attention, block)
    total = len(PROMPT) + GEN_LENGTH
    expected = []
    with torch.no_grad():
        for j in range(len(ANSWER)):
            x = torch.tensor([PROMPT + ANSWER[:j] + [MASK] * (GEN_LENGTH - j)])
            logits = model(input_ids=x, attention_mask=loop_mask(attention, block, len(PROMPT), total)).logits
            expected.append(int(logits[0, len(PROMPT) + j - 1].argmax()))
    guesses = mdm_guesses(model, PROMPT, ANSWER, GEN_LENGTH)
    assert guesses == expected
    assert len(set(guesses)) > 1  # the comparison is not between constant outputs


def test_ar_guesses_equal_one_forward_per_prefix():
    model = tiny_model(VOCAB, "qwen3", seed=2).eval()
    with torch.no_grad():
        expected = [int(model(input_ids=torch.tensor([PROMPT + ANSWER[:j]])).logits[0, -1].argmax())
                    for j in range(len(ANSWER))]
    assert ar_guesses(model, PROMPT, ANSWER) == expected


def test_score_counts_digits_and_whole_problems():
    tok = build_synthetic_tokenizer(OmegaConf.structured(DataConfig).synthetic)
    rows = [{"prompt": "Question: Tom has 5 apples.\nAnswer:", "response": " Tom has 5 + 3 = 8 apples.\n#### 8"}] * 2
    answer = tok(rows[0]["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    digit_slots = [i for i, t in enumerate(answer) if tok.decode([t]).strip().isdigit()]
    assert len(digit_slots) == 4  # 5, 3, 8, 8
    calls = iter([list(answer), [tok.eos_token_id if i == digit_slots[2] else t for i, t in enumerate(answer)]])
    result = score(rows, tok, lambda prompt, ans: next(calls))
    n = len(answer)
    assert result["tokens"] == 2 * n
    assert result["accuracy_all"] == pytest.approx((2 * n - 1) / (2 * n))
    assert result["accuracy_digits"] == pytest.approx(7 / 8)
    assert result["accuracy_other"] == 1.0
    assert result["all_correct"] == 0.5


def test_prompt_and_answer_follow_the_chat_template_a_chat_base_was_trained_on():
    """A chat tokenizer's probe prompt is the rendered user turn with the generation prompt, and its answer
    the rendered assistant turn up to and including ``<|im_end|>`` (where decoding stops), not the raw text."""
    tok, row = chat_bpe_tokenizer(), EVAL_ROWS[0]
    prompt, answer = prompt_and_answer(tok, row)
    rendered = tok.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                        {"role": "assistant", "content": row["response"]}], tokenize=False)
    assert rendered.startswith(tok.decode(prompt + answer)) and rendered != tok.decode(prompt + answer)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n") and row["prompt"] in tok.decode(prompt)
    assert answer[-1] == tok.convert_tokens_to_ids("<|im_end|>") and answer.count(answer[-1]) == 1
    assert tok.decode(answer[:-1]) == row["response"]
    assert prompt_and_answer(tok, row, "plain") == (tok(row["prompt"], add_special_tokens=False)["input_ids"],
                                                    tok(row["response"], add_special_tokens=False)["input_ids"]
                                                    + [tok.eos_token_id])


def test_prompt_and_answer_without_a_chat_template_are_the_plain_text_and_eos():
    tok, row = tiny_tokenizer(), EVAL_ROWS[1]
    prompt, answer = prompt_and_answer(tok, row)
    assert prompt == tok(row["prompt"], add_special_tokens=False)["input_ids"]
    assert answer == tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
