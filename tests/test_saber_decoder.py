"""Saber decoder (``decoder=saber``): the adaptive threshold, the draft and re-mask rules on hand-built
probability tables; the decode equals a slow reference written here (full recompute each step, masks built pair
by pair, rules in plain Python) in tokens, forwards and revision counts; valid outputs, EOS stop, named errors,
the recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from pardec.common.errors import ConfigError
from pardec.inference.config import validate_validate_config
from pardec.inference.decoders.registry import build_decoder
from pardec.inference.decoders.saber import SaberConfig, adaptive_threshold, remask_count, saber_step
from tests.test_mdm_decoders import (
    EOS,
    MASK,
    PROMPTS,
    committed_answer,
    decoded_up_to_eos,
    full_logits,
    mdm_model,
    mdm_tokenizer,
)

torch.set_num_threads(1)

L, B = 12, 4


# -- the rules on hand-built tables -----------------------------------------------------------------


def test_adaptive_threshold_is_the_mean_unmask_confidence_of_the_decoded_positions():
    unmask_conf = torch.tensor([0.5, 0.9, 0.7, 0.2], dtype=torch.float64)
    assert adaptive_threshold(unmask_conf, torch.tensor([True, False, True, False])) == pytest.approx(0.6)
    assert adaptive_threshold(unmask_conf, torch.zeros(4, dtype=torch.bool)) == 1.0  # nothing decoded: c_max


def test_remask_count():
    cases = {(1, 2, 8): 0, (2, 2, 8): 1, (8, 2, 8): 1, (9, 2, 8): 2, (17, 2, 8): 3, (3, 6, 8): 2, (10, 1, 8): 2,
             (10, 2, 1): 9, (1, 1, 8): 0}
    assert {k: remask_count(*k) for k in cases} == cases  # (drafted, min_tokens, divisor) -> mu_t


# Block of 7 over a vocabulary of 4: positions 0, 2, 5 hold tokens 1, 2, 0 (decoded before the step, with
# last step's confidences 0.9, 0.8, 0.6); 1, 3, 4, 6 are masked (argmax confidences 0.7, 0.5, 0.9, 0.4).
PROBS = torch.tensor([
    [0.20, 0.50, 0.20, 0.10],  # holds 1: 0.5 now, drop 0.4
    [0.10, 0.70, 0.10, 0.10],
    [0.05, 0.90, 0.05, 0.00],  # holds 2: 0.05 now, drop 0.75 (its argmax probability rose to 0.9)
    [0.50, 0.20, 0.20, 0.10],
    [0.00, 0.05, 0.05, 0.90],
    [0.10, 0.30, 0.30, 0.30],  # holds 0: 0.1 now, drop 0.5
    [0.40, 0.30, 0.20, 0.10],
])
CURRENT = torch.tensor([1, MASK, 2, MASK, MASK, 0, MASK])
MASKED = CURRENT == MASK
PREVIOUS = torch.tensor([0.9, 0.0, 0.8, 0.0, 0.0, 0.6, 0.0])


@pytest.mark.parametrize("tau,n,mu,drafted,remasked", [
    (0.6, 2, 8, [1, 4], [2]),  # two pass; mu_t = max(1, ceil(2/8)) = 1: the largest drop
    (0.45, 2, 1, [1, 3, 4], [2, 5]),  # three pass; mu_t = min(ceil(3/1), 3 - 1) = 2
    (0.45, 2, 8, [1, 3, 4], [2]),
    (0.8, 2, 8, [1, 4], [2]),  # only 4 passes: the 2 most confident instead
    (0.8, 3, 8, [1, 3, 4], [2]),
    (0.95, 1, 8, [4], []),  # none passes: the top-1; mu_t capped at |D_t| - 1 = 0
    (0.3, 2, 8, [1, 3, 4, 6], []),  # the drafts complete the block: no re-mask
    (0.95, 5, 8, [1, 3, 4, 6], []),  # the minimum is capped at the masked count
])
def test_draft_and_remask_on_a_probability_table(tau, n, mu, drafted, remasked):
    assert saber_step(PROBS, CURRENT, MASKED, PREVIOUS, tau, n, mu) == (drafted, remasked)


def test_ties_go_to_the_lower_offset_and_candidates_are_only_earlier_decoded_positions():
    probs = torch.full((5, 3), 1 / 3)
    current = torch.tensor([0, MASK, MASK, MASK, 2])
    previous = torch.tensor([0.5, 0.99, 0.99, 0.99, 0.5])  # masked positions are never candidates
    assert saber_step(probs, current, current == MASK, previous, 0.5, 2, 8) == ([1, 2], [0])
    current = torch.tensor([0, 1, MASK, 1, 2])
    assert saber_step(probs, current, current == MASK, previous, 0.9, 2, 8) == ([2], [])  # one masked left


# -- the decode against a slow reference ------------------------------------------------------------


def reference_saber(model, prompt, length, block, n, mu, attention, attn_block=None, eos=EOS):
    """Saber step by step: a full forward per step, plain-Python rules and counters."""
    x = list(prompt) + [MASK] * length
    p_len, forwards = len(prompt), 0
    unmasked_with: dict[int, float] = {}  # position -> confidence when last unmasked
    events, pending, flips = [], {}, 0

    for b in range(length // block):
        s = p_len + b * block
        previous: dict[int, float] = {}
        while MASK in x[s : s + block]:
            logits = full_logits(model, x, p_len, attention, attn_block)
            forwards += 1
            probs = [torch.softmax(logits[s + o - 1].float(), -1) for o in range(block)]
            masked = [o for o in range(block) if x[s + o] == MASK]
            earlier = [o for o in range(block) if x[s + o] != MASK]
            live = [unmasked_with[p] for p in range(p_len, len(x)) if x[p] != MASK]
            tau = sum(live) / len(live) if live else 1.0
            conf = {o: float(probs[o].max()) for o in masked}
            drafted = [o for o in masked if conf[o] > tau]
            if len(drafted) < n:
                drafted = sorted(masked, key=lambda o: (-conf[o], o))[:n]
            low = []
            if len(drafted) < len(masked):
                k = min(max(n // 2, math.ceil(len(drafted) / mu)), len(drafted) - 1)
                drop = {o: previous[o] - float(probs[o][x[s + o]]) for o in earlier}
                low = sorted(earlier, key=lambda o: (-drop[o], o))[:k]
            for o in low:
                events.append((s + o, x[s + o]))
                pending[s + o] = x[s + o]
                x[s + o] = MASK
            for o in drafted:
                token = int(probs[o].argmax())
                x[s + o] = token
                unmasked_with[s + o] = conf[o]
                flips += pending.pop(s + o, None) == token
            previous = {o: float(probs[o][x[s + o]]) for o in range(block) if x[s + o] != MASK}
            if decoded_up_to_eos(x, p_len, eos):
                break
        if decoded_up_to_eos(x, p_len, eos):
            break
    effective = sum(1 for pos, old in events if x[pos] not in (MASK, old))
    return committed_answer(x, p_len, eos), forwards, len(events), flips, effective


def saber(cfg: dict, model, prompt, eos=EOS, block=B):
    decoder = build_decoder({"name": "saber", "max_new_tokens": L, "block_size": block, **cfg}, mdm_tokenizer())
    with decoder.prepare(model):
        return decoder.decode(model, [prompt], {eos}, [0])[0], decoder


@pytest.mark.parametrize("attention", ["bidirectional", "block"])
def test_saber_equals_the_reference(attention):
    model = mdm_model(attention, block=B if attention == "block" else None)
    total = shorter = 0
    for n, mu in [(2, 8), (1, 8), (2, 1), (3, 2)]:
        for block in (B, L):  # L: one block, as the official configs
            for prompt in PROMPTS:
                cfg = {"min_tokens": n, "remask_divisor": mu}
                full, _ = saber(cfg, model, prompt, -1, block=block)
                for eos in (-1, full.tokens[5]):  # no EOS; a token the run emits, called EOS
                    result, _ = saber(cfg, model, prompt, eos, block=block)
                    attn_block = B if attention == "block" else None
                    ref = reference_saber(model, prompt, L, block, n, mu, attention, attn_block, eos)
                    st = result.stats
                    got = (result.tokens, result.forwards, st["revisions"], st["flip_flops"], st["effective_revisions"])
                    assert got == ref, (attention, n, mu, block, prompt, eos)
                    total += ref[2]
                    shorter += len(result.tokens) < L
    assert total > 0 and shorter > 0  # the re-mask path and the EOS stop are exercised


def test_saber_outputs_and_stats():
    model = mdm_model("bidirectional")
    records = []
    for block in (B, L):
        for prompt in PROMPTS:
            result, decoder = saber({}, model, prompt, eos=-1, block=block)
            assert len(result.tokens) == L and MASK not in result.tokens and not result.hit_eos
            assert L / block <= result.forwards <= L  # at least one position gained per step
            st = result.stats
            assert st["steps"] == st["dlm_forwards"] == result.forwards and st["guide_forwards"] == 0
            assert st["revisions"] == st["remasks"] and st["replaces"] == 0
            assert 0 <= st["effective_revisions"] <= st["revisions"] and st["flip_flops"] <= st["remasks"]
            assert st["tokens_per_step"] == pytest.approx(L / result.forwards)
            records.append({"stats": st, "committed": result.committed})
    assert any(r["stats"]["revisions"] for r in records)
    summary = decoder.summarize(records)
    assert summary["tokens_per_step"] == pytest.approx(summary["tpf_dlm"])
    assert summary["revisions_per_sample"] == pytest.approx(sum(r["stats"]["revisions"] for r in records) / 6)
    assert 0 <= summary["effective_revision_ratio"] <= 1


def test_saber_stops_at_eos():
    model = mdm_model("bidirectional")
    full, _ = saber({}, model, PROMPTS[0], eos=-1)
    eos = full.tokens[5]  # a token the run emits: call it EOS
    stopped, _ = saber({}, model, PROMPTS[0], eos=eos)
    assert stopped.hit_eos and stopped.tokens[-1] == eos and eos not in stopped.tokens[:-1]
    assert MASK not in stopped.tokens and stopped.forwards <= full.forwards


# -- errors and the recipe ----------------------------------------------------------------------------


def test_saber_named_errors():
    # a checkpoint that is not an MDM export: test_mdm_decoders.test_non_mdm_checkpoint_is_a_named_error
    for key, value in (("min_tokens", 0), ("remask_divisor", 0), ("freecache", True), ("block_size", 5)):
        with pytest.raises(ConfigError, match=f"decoder.{key}"):
            build_decoder({"name": "saber", "max_new_tokens": L, key: value}, mdm_tokenizer()).decode(
                mdm_model("bidirectional"), [PROMPTS[0]], {EOS}, [0])


def test_saber_recipe_composes_to_the_defaults():
    import pardec.cli.validate  # noqa: F401  (registers the validate_schema config node)

    recipes = Path(__file__).resolve().parents[1] / "pardec" / "recipes"
    first_line = (recipes / "decoder" / "saber.yaml").read_text().splitlines()[0]
    assert first_line == "# python -m pardec.cli.validate checkpoint=<MDM export> decoder=saber"
    with initialize_config_dir(config_dir=str(recipes), version_base="1.3"):
        cfg = validate_validate_config(compose("validate", overrides=["checkpoint=/x", "decoder=saber"]))
    assert cfg.decoder == SaberConfig()
