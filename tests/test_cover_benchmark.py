"""``pardec.benchmarks.cover``'s choice of tau_draft on validation (``--select``), on hand-made rows."""

from __future__ import annotations

from pardec.benchmarks.cover import choose_tau

TUNING = [  # validation rows of three taus: faster is less accurate
    {"tau_draft": 0.7, "accuracy": 0.70, "steps_per_sample": 12.0},
    {"tau_draft": 0.8, "accuracy": 0.80, "steps_per_sample": 13.0},
    {"tau_draft": 0.9, "accuracy": 0.90, "steps_per_sample": 14.0},
]


def test_accuracy_rule_takes_the_most_accurate_then_the_fewest_steps():
    assert choose_tau(TUNING, "accuracy")["tau_draft"] == 0.9
    tied = TUNING + [{"tau_draft": 0.95, "accuracy": 0.90, "steps_per_sample": 13.5}]
    assert choose_tau(tied, "accuracy")["tau_draft"] == 0.95


def test_baselines_rule_takes_the_fewest_steps_at_the_baselines_accuracy_or_better():
    assert choose_tau(TUNING, "baselines", baseline_accuracy=0.75)["tau_draft"] == 0.8
    assert choose_tau(TUNING, "baselines", baseline_accuracy=0.70)["tau_draft"] == 0.7  # equal accuracy counts
    assert choose_tau(TUNING, "baselines", baseline_accuracy=0.95)["tau_draft"] == 0.9  # none: the most accurate
