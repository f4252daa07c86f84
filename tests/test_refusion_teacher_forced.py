"""pardec.benchmarks.refusion_teacher_forced: the slot-position split of teacher-forced accuracy, on scripted
guesses (the guesses themselves are ``ar_guesses``, tested in tests/test_mdm_teacher_forced.py)."""

from __future__ import annotations

from pardec.benchmarks.refusion_teacher_forced import plan_guesses, slot_position_accuracy


def test_splits_slot_starts_from_in_slot_positions():
    answers = [[1, 2, 3, 4, 5], [6, 7, 8]]
    guesses = [[1, 0, 3, 0, 5],  # k = 2: slot starts j = 0, 2, 4 all right; in-slot j = 1, 3 both wrong
               [0, 7, 8]]  # slot starts j = 0 wrong, 2 right; in-slot j = 1 right
    out = slot_position_accuracy(guesses, answers, k=2)
    assert out["tokens_slot_start"] == 5 and out["tokens_in_slot"] == 3
    assert out["accuracy_slot_start"] == 4 / 5
    assert out["accuracy_in_slot"] == 1 / 3
    assert out["all_correct"] == 0.0
    assert slot_position_accuracy([[1, 2, 3]], [[1, 2, 3]], k=8) == {
        "accuracy_slot_start": 1.0, "accuracy_in_slot": 1.0, "tokens_slot_start": 1, "tokens_in_slot": 2,
        "all_correct": 1.0}


def test_no_problems_gives_no_accuracy():
    out = slot_position_accuracy([], [], k=4)
    assert out["accuracy_slot_start"] is None and out["all_correct"] is None


def test_plan_guesses_equal_a_forward_under_the_decoders_mask_per_slot_start():
    """Each slot start's plan guess equals the first mask's argmax of a forward built another way:
    the decoder's own predicate (every entry shared) as an explicit dense mask, explicit positions."""
    import torch

    from pardec.masks.core import additive_mask
    from pardec.masks.refusion import SHARED, refusion_decode_mask
    from tests.conftest import tiny_model

    vocab, mask_id, k, max_new = 40, 39, 3, 7
    model = tiny_model(vocab, "qwen3", seed=1).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 60.0)  # spread the argmaxes
    model.config.tie_word_embeddings = False
    prompt, answer = [3, 4, 5], [6, 7, 8, 9, 10, 11, 12]
    expected = []
    with torch.no_grad():
        for j in range(0, len(answer), k):
            ids = prompt + answer[:j] + [mask_id] * min(k, max_new - j)
            n = len(ids)
            mask = additive_mask(refusion_decode_mask(torch.full((1, n), SHARED)), 1, n, n, model.dtype, "cpu")
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(n)[None],
                           attention_mask=mask).logits
            expected.append(int(logits[0, len(prompt) + j].argmax()))
    guesses = plan_guesses(model, prompt, answer, k, mask_id, max_new)
    assert guesses == expected and len(guesses) == 3  # slot starts j = 0, 3, 6 (the last slot capped to 1 mask)
    assert len(set(guesses)) > 1
