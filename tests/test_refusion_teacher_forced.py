"""benchmarks.refusion_teacher_forced: the slot-position split of teacher-forced accuracy, on scripted
guesses (the guesses themselves are ``ar_guesses``, tested in tests/test_mdm_teacher_forced.py)."""

from __future__ import annotations

from benchmarks.refusion_teacher_forced import slot_position_accuracy


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
