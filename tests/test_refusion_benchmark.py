"""pardec.benchmarks.refusion: the validation rule that picks (b, tau, first token), on hand-built tables,
and the test phase's ablations of the chosen setting."""
from pardec.benchmarks.refusion import OWN_AR, ablations, choose_setting, label


def _setting(block: int, tau: float, first: str = "mask") -> dict:
    return {"block_size": block, "threshold": tau, "first_token": first}


def _row(name: str, accuracy: float, tpf: float, setting: dict | None = None) -> dict:
    config = {"name": "ar"} if setting is None else {"name": "refusion", **setting}
    return {"decoder": name, "accuracy": accuracy, "tpf": tpf, "config": config}


def _table(*settings: tuple) -> list[dict]:
    rows = [_row("AR greedy (base)", 0.90, 1.0), _row(OWN_AR, 0.99, 1.0)]
    return rows + [_row(label(_setting(b, tau, *first)), acc, tpf, _setting(b, tau, *first))
                   for b, tau, acc, tpf, *first in settings]


def test_picks_the_fastest_setting_within_the_tolerated_drop():
    table = _table((8, 0.9, 0.89, 2.1), (8, 0.5, 0.88, 2.4), (16, 0.5, 0.87, 3.0), (16, 0.9, 0.80, 3.5))
    setting, rule = choose_setting(table, max_drop=0.02)
    assert setting == _setting(8, 0.5)
    assert "highest TPF" in rule


def test_the_first_token_source_is_part_of_the_choice():
    table = _table((8, 0.5, 0.86, 2.9), (8, 0.5, 0.89, 2.8, "ar"), (8, 0.3, 0.87, 3.0, "ar"))
    assert choose_setting(table, max_drop=0.02)[0] == _setting(8, 0.5, "ar")


def test_own_ar_row_is_never_chosen_and_does_not_set_the_bar():
    # the checkpoint's own AR greedy is more accurate than the base; the bar stays the base's accuracy
    table = _table((8, 0.7, 0.885, 2.2), (16, 0.7, 0.70, 2.9))
    assert choose_setting(table, max_drop=0.02)[0] == _setting(8, 0.7)


def test_falls_back_to_the_most_accurate_then_the_fastest():
    table = _table((8, 0.9, 0.80, 2.1), (8, 0.5, 0.80, 2.4), (16, 0.5, 0.60, 3.0))
    setting, rule = choose_setting(table, max_drop=0.02)
    assert setting == _setting(8, 0.5)
    assert "most accurate" in rule


def test_ablations_flip_the_first_token_only_where_b_is_k():
    assert ablations(_setting(8, 0.5, "ar"), slot_size=8) == [{"kv_reuse": False}, {"fuse_plan": False},
                                                               {"first_token": "mask"}]
    assert ablations(_setting(16, 0.5), slot_size=8) == [{"kv_reuse": False}, {"fuse_plan": False}]
    chosen = _setting(8, 0.5, "ar")
    assert label(chosen, first_token="mask") == label(_setting(8, 0.5, "mask"))
    assert label(chosen, kv_reuse=False) == "ReFusion b=8 tau=0.5 first_token=ar, kv_reuse=false"
