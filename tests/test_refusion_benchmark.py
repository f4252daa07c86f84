"""benchmarks.refusion: the validation rule that picks (b, tau), on hand-built tables."""
from benchmarks.refusion import OWN_AR, choose_setting, label


def _row(name: str, accuracy: float, tpf: float, block: int | None = None, tau: float | None = None) -> dict:
    config = {"name": "ar"} if block is None else {"name": "refusion", "block_size": block, "threshold": tau}
    return {"decoder": name, "accuracy": accuracy, "tpf": tpf, "config": config}


def _table(*settings: tuple[int, float, float, float]) -> list[dict]:
    rows = [_row("AR greedy (base)", 0.90, 1.0), _row(OWN_AR, 0.99, 1.0)]
    return rows + [_row(label(b, tau), acc, tpf, b, tau) for b, tau, acc, tpf in settings]


def test_picks_the_fastest_setting_within_the_tolerated_drop():
    table = _table((8, 0.9, 0.89, 2.1), (8, 0.5, 0.88, 2.4), (16, 0.5, 0.87, 3.0), (16, 0.9, 0.80, 3.5))
    (block, tau), rule = choose_setting(table, max_drop=0.02)
    assert (block, tau) == (8, 0.5)
    assert "highest TPF" in rule


def test_own_ar_row_is_never_chosen_and_does_not_set_the_bar():
    # the checkpoint's own AR greedy is more accurate than the base; the bar stays the base's accuracy
    table = _table((8, 0.7, 0.885, 2.2), (16, 0.7, 0.70, 2.9))
    assert choose_setting(table, max_drop=0.02)[0] == (8, 0.7)


def test_falls_back_to_the_most_accurate_then_the_fastest():
    table = _table((8, 0.9, 0.80, 2.1), (8, 0.5, 0.80, 2.4), (16, 0.5, 0.60, 3.0))
    (block, tau), rule = choose_setting(table, max_drop=0.02)
    assert (block, tau) == (8, 0.5)
    assert "most accurate" in rule
