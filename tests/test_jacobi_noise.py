"""Noise schedules and noisy-state selection on hand-built Jacobi trajectories."""

from __future__ import annotations

from fractions import Fraction

import pytest

from pardec.data_pipelines.jacobi_noise import noise_ratios, select_noisy_blocks, select_state, unconverged_count

F = Fraction


def test_progressive_schedule_cycles_through_the_window():
    assert noise_ratios(7, 3, "progressive") == [F(0), F(1, 3), F(2, 3), F(0), F(1, 3), F(2, 3), F(0)]
    assert noise_ratios(3, 16, "progressive") == [F(0), F(1, 16), F(2, 16)]
    assert noise_ratios(4, 1, "progressive") == [F(0)] * 4


def test_reverse_progressive_decreases_from_one():
    assert noise_ratios(5, 4, "reverse_progressive") == [F(1), F(3, 4), F(2, 4), F(1, 4), F(1)]


def test_random_schedule_is_seeded_per_sample_and_on_the_grid():
    a = noise_ratios(50, 8, "random", (0, 3))
    assert a == noise_ratios(50, 8, "random", (0, 3))
    assert a != noise_ratios(50, 8, "random", (0, 4))
    assert set(a) <= {F(k, 8) for k in range(8)} and len(set(a)) > 1


def test_bad_schedule_and_window_are_named():
    with pytest.raises(ValueError, match="'linear'"):
        noise_ratios(3, 2, "linear")
    with pytest.raises(ValueError, match="window w must be >= 1, got 0"):
        noise_ratios(3, 0, "progressive")


def test_unconverged_count_is_n_minus_matching_prefix():
    fp = [5, 6, 7, 8]
    assert unconverged_count([5, 6, 7, 8], fp, 4) == 0
    assert unconverged_count([5, 1, 7, 8], fp, 4) == 3  # a later match does not count
    assert unconverged_count([5, 6, 9, 9], fp, 4) == 2
    assert unconverged_count([5, 6, 9, 9], fp, 2) == 0  # EOS block: only valid tokens compared


# One block, n = 8: unconverged counts 7, 5, 2, 0 along its trajectory.
FP = [1, 2, 3, 4, 5, 6, 7, 8]
TRAJ = [[1, 9, 9, 9, 9, 9, 9, 9], [1, 2, 3, 9, 9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 9, 9], FP]


@pytest.mark.parametrize("t,expected", [
    (F(0), 3),  # target 0: the fixed point itself
    (F(1, 8), 2),  # target 1: counts 2 and 0 are both 1 away -> the noisier (2)
    (F(2, 8), 2),
    (F(3, 8), 2),  # target 3: count 2 is 1 away, 5 is 2 away
    (F(4, 8), 1),  # target 4: count 5 is 1 away
    (F(6, 8), 0),  # target 6: counts 5 and 7 are both 1 away -> the noisier (7)
    (F(7, 8), 0),
    (F(1), 0),  # target 8: the noisiest available state
])
def test_select_state_closest_count_ties_to_noisier(t, expected):
    assert [unconverged_count(s, FP, 8) for s in TRAJ] == [7, 5, 2, 0]
    assert select_state(TRAJ, FP, 8, t) == expected


def test_target_is_exact_ceil():
    """ceil(t * n) in exact arithmetic: 0.3 * 10 is 3.0000000000000004 in floating point."""
    fp = list(range(10))
    states = [[0] + [99] * 9, list(range(6)) + [99] * 4, [0, 1, 2, 3, 4, 5, 6, 99, 99, 99], fp]
    counts = [unconverged_count(s, fp, 10) for s in states]
    assert counts == [9, 4, 3, 0]
    assert select_state(states, fp, 10, F(3, 10)) == 2  # target 3, not 4


def test_eos_block_uses_its_valid_length():
    fp = [4, 5, 0, 0]  # EOS = 0 at offset 2, post-EOS padded
    states = [[4, 9, 0, 0], [4, 5, 9, 0], fp]  # counts over 3 valid tokens: 2, 1, 0
    assert select_state(states, fp, 3, F(1, 2)) == 0  # ceil(0.5 * 3) = 2
    assert select_state(states, fp, 3, F(1, 4)) == 1  # ceil(0.75) = 1


def test_select_noisy_blocks_follows_the_progressive_schedule():
    blocks = [TRAJ, TRAJ, TRAJ, TRAJ]
    noisy = select_noisy_blocks(blocks, [FP] * 4, [8] * 4, window=4, schedule="progressive")
    # t = 0, 1/4, 2/4, 3/4 -> targets 0, 2, 4, 6 -> counts 0, 2, 5, 7
    assert noisy == [FP, TRAJ[2], TRAJ[1], TRAJ[0]]
    with pytest.raises(ValueError, match="block 1: a block's trajectory has no state"):
        select_noisy_blocks([TRAJ, []], [FP, FP], [8, 8], window=2, schedule="progressive")


def test_random_window_phase_shifts_each_sample_window_and_covers_every_level():
    # Phase zero is the paper's schedule (docs/methods/jacobi_forcing.md#noise-schedule).
    assert noise_ratios(5, 3, "progressive", (0, 1), "zero") == noise_ratios(5, 3, "progressive")
    phases = set()
    for index in range(60):
        ratios = noise_ratios(5, 3, "progressive", (0, index), "random")
        assert ratios == noise_ratios(5, 3, "progressive", (0, index), "random")  # deterministic
        phi = int(ratios[0] * 3)
        # A shifted window, still a linear ramp: t_i = W[(i + phi) mod w].
        assert ratios == [F((i + phi) % 3, 3) for i in range(5)]
        phases.add(phi)
        rev = noise_ratios(5, 3, "reverse_progressive", (0, index), "random")
        assert rev == [1 - F((i + phi) % 3, 3) for i in range(5)]
    # Block 0 is noised at every level over the data set (phase zero never noises it).
    assert phases == {0, 1, 2}
    with pytest.raises(ValueError, match="is not a valid WindowPhase"):
        noise_ratios(3, 2, "progressive", (0,), "sometimes")
    with pytest.raises(ValueError, match="is not a valid WindowPhase"):
        noise_ratios(3, 2, "random", (0,), "sometimes")
