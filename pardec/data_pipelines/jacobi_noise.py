"""Noise schedules and noisy-state selection for Jacobi Forcing
(docs/methods/jacobi_forcing.md#noise-schedule, paper Eq. 7 and App. C).

A noise ratio is kept as an exact fraction k / w (k in 0..w), so ``ceil(t * n)`` is integer
arithmetic and never off by one through floating point.

Schedules over the blocks i = 0, 1, ... of one sample, window size w, W = {0, 1/w, ..., (w-1)/w}:

* ``progressive`` (paper Eq. 7): t_i = W[i mod w], the noise ratio rises linearly inside each
  window, so every window starts from a clean block;
* ``reverse_progressive`` (ablation, Table 4, "linearly decreasing from 1 to 0 within each
  window"): t_i = 1 - W[i mod w], i.e. 1, (w-1)/w, ..., 1/w;
* ``random`` (ablation): t_i drawn uniformly from W, independently per block, from a generator
  seeded by (seed, sample index), so a sample's choice does not depend on sharding or order.

Window phase (the two window schedules). ``zero`` (default, paper Eq. 7): the windows start at the
sample's first block, so block 0 is always clean. In the paper a window spans w * n = 256 tokens
and answers run to many windows, so where a block sits inside its window is unrelated to where it
sits in the answer. On short answers (a few blocks) phase zero ties the two:
block 0 is never noised (it gets no consistency pair at all) and block i only ever sees t = W[i].
``random`` shifts each sample's windows by phi drawn uniformly from {0, ..., w-1} (seeded by
(seed, sample index), a stream separate from the random schedule's): t_i = W[(i + phi) mod w], so
every answer position is trained at every noise level across the data set, and each window still
ramps linearly.

Selection: a state's *unconverged count* is n - (length of its longest prefix equal to the fixed
point). For block i the chosen state is the trajectory point whose count is closest to
``ceil(t_i * n)``; ties go to the noisier state (larger count). Only the block's valid tokens are
compared: in the block that holds EOS, n is the number of tokens up to and including EOS (the
post-EOS tail is never trained on), both for the count and for ``ceil(t_i * n)``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

import numpy as np

from pardec.common.config_fields import Choice


class NoiseSchedule(Choice):
    progressive = "progressive"
    reverse_progressive = "reverse_progressive"
    random = "random"


class WindowPhase(Choice):
    zero = "zero"
    random = "random"


_PHASE_STREAM = 1  # appended to the seed: the phase's draws never coincide with the random schedule's


def window_phase(window: int, phase: str, seed: Sequence[int] = (0,)) -> int:
    """The shift phi of a sample's windows: 0 for ``zero``, uniform in {0..w-1} for ``random``."""
    if WindowPhase(phase) == "zero":  # ValueError naming the choices for any other
        return 0
    return int(np.random.default_rng([*seed, _PHASE_STREAM]).integers(0, window))


def noise_ratios(
    num_blocks: int, window: int, schedule: str, seed: Sequence[int] = (0,), phase: str = "zero"
) -> list[Fraction]:
    """t_i for blocks 0..num_blocks-1. ``seed`` (e.g. ``(seed, sample_index)``) is used by the
    ``random`` schedule and the ``random`` window phase."""
    if window < 1:
        raise ValueError(f"noise window w must be >= 1, got {window}")
    phi = window_phase(window, phase, seed)  # validates phase; the random schedule ignores it
    schedule = NoiseSchedule(schedule)  # ValueError naming the choices
    if schedule == "progressive":
        ks = [(i + phi) % window for i in range(num_blocks)]
    elif schedule == "reverse_progressive":
        ks = [window - (i + phi) % window for i in range(num_blocks)]
    else:  # random
        ks = np.random.default_rng(list(seed)).integers(0, window, size=num_blocks).tolist()
    return [Fraction(k, window) for k in ks]


def unconverged_count(state: Sequence[int], fixed_point: Sequence[int], valid_len: int) -> int:
    """valid_len - length of the longest prefix of ``state[:valid_len]`` equal to the fixed point."""
    matched = 0
    while matched < valid_len and state[matched] == fixed_point[matched]:
        matched += 1
    return valid_len - matched


def select_state(states: Sequence[Sequence[int]], fixed_point: Sequence[int], valid_len: int, t: Fraction) -> int:
    """Index of the state whose unconverged count is closest to ``ceil(t * valid_len)``; ties go to
    the noisier state (then to the earlier one, for determinism)."""
    if not states:
        raise ValueError("a block's trajectory has no state")
    target = -(-t.numerator * valid_len // t.denominator)  # ceil(t * n), exact
    counts = [unconverged_count(s, fixed_point, valid_len) for s in states]
    return min(range(len(states)), key=lambda i: (abs(counts[i] - target), -counts[i], i))


def select_noisy_blocks(
    states: Sequence[Sequence[Sequence[int]]],
    fixed_points: Sequence[Sequence[int]],
    valid_lens: Sequence[int],
    window: int,
    schedule: str,
    seed: Sequence[int] = (0,),
    phase: str = "zero",
) -> list[list[int]]:
    """One noisy state per block (``states[i]`` is block i's trajectory), following the schedule."""
    ratios = noise_ratios(len(fixed_points), window, schedule, seed, phase)
    chosen = []
    blocks = zip(states, fixed_points, valid_lens, ratios, strict=True)
    for i, (trajectory, fixed_point, valid_len, t) in enumerate(blocks):
        try:
            chosen.append(list(trajectory[select_state(trajectory, fixed_point, valid_len, t)]))
        except ValueError as err:
            raise ValueError(f"block {i}: {err}") from None
    return chosen
