"""MDM decoders with ``cuda_graphs`` (pardec.inference.decoders.mdm_common, "CUDA graphs"): over the
static steps (run eagerly on CPU) every MDM decoder but COVER (which keeps no cache) decodes what it
decodes without them, token for token with the same forwards and stats, every DLM and guide forward
goes through the static steps, FreeCache freezes the same K/V, and every width is prepared before the
first step (COVER's static forwards: tests/test_cover_cuda_graphs.py). The CUDA test checks the
captured graphs."""

from __future__ import annotations

import pytest
import torch

from pardec.inference.decoders.decode_steps import SMALL, StepsPool, step_width
from pardec.inference.decoders.registry import build_decoder
from tests.test_mdm_decoders import EOS, PROMPTS, guide_dir, load_guide, mdm_model, mdm_tokenizer  # noqa: F401

torch.set_num_threads(1)

L, B = 12, 4
CASES = {
    "lowconf": {"name": "mdm_lowconf", "steps_per_block": 2},
    "threshold": {"name": "mdm_threshold", "threshold": 0.7, "prefix_cache": False},
    "threshold_prefix_cache": {"name": "mdm_threshold", "threshold": 0.7},
    "threshold_freecache": {"name": "mdm_threshold", "threshold": 0.7, "freecache": True},
    "freecache_refresh": {"name": "mdm_lowconf", "steps_per_block": 2, "freecache": True},
    "freecache_freeze_last": {"name": "mdm_lowconf", "steps_per_block": 2, "freecache": True,
                              "freecache_mode": "freeze_last"},
    "saber": {"name": "saber"},
    "wino": {"name": "wino"},
}
GUIDED = {
    "guided_assisted_freecache": {"name": "mdm_guided", "freecache": True},
    "guided_shifted": {"name": "mdm_guided", "commit": "shifted"},
}


def static_forwards(model) -> list[int]:
    """Appends, per forward of ``model``, whether its mask spans a static cache (``[1, 1, q, max_len]``)."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        steps = StepsPool._static.get(module)
        seen.append(steps is not None and kwargs["attention_mask"].shape[-1] == steps.max_len)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def decode(cfg: dict, model, prompt, guide=None, snapshots=False):
    decoder = build_decoder(cfg, mdm_tokenizer())
    if guide is not None:
        decoder.use_auxiliary({"guide": guide})
    if snapshots:
        decoder.kv_snapshots = []
    with decoder.prepare(model):
        return decoder.decode(model, [prompt], {EOS}, [0])[0], decoder


def check_static_equals_eager(cfg: dict, attention: str, guide=None):
    model = mdm_model(attention, block=B if attention == "block" else None)
    cfg = {**cfg, "max_new_tokens": L, "block_size": B}
    dlm_static = static_forwards(model)
    guide_static = static_forwards(guide) if guide is not None else []
    decode({**cfg, "cuda_graphs": True}, model, PROMPTS[0], guide)  # allocates the static caches (a forward each)
    for prompt in PROMPTS:
        eager, eager_decoder = decode(cfg, model, prompt, guide, snapshots=True)
        dlm_static.clear()
        guide_static.clear()
        before = set(StepsPool._static[model]._steps)
        got, decoder = decode({**cfg, "cuda_graphs": True}, model, prompt, guide, snapshots=True)
        assert got.tokens == eager.tokens and got.forwards == eager.forwards, (cfg, prompt)
        assert got.stats == eager.stats, (cfg, prompt)
        assert dlm_static and all(dlm_static), "a DLM forward bypassed the static steps"
        assert len(dlm_static) == got.stats["dlm_forwards"]
        if guide is not None:  # its prefill (not counted) and its steps, all over the static cache
            assert all(guide_static) and len(guide_static) == got.stats["guide_forwards"] + 1 > 1
        widest = decoder.widest_step(len(prompt) + L, B)
        prepared = {step_width(q) for q in range(1, widest + 1)}
        assert set(StepsPool._static[model]._steps) == before | prepared  # no width beyond those prepared
        assert StepsPool._static[model].max_len >= widest + SMALL
        assert len(decoder.kv_snapshots) == len(eager_decoder.kv_snapshots)
        for snap, ref in zip(decoder.kv_snapshots, eager_decoder.kv_snapshots):
            assert snap["frozen_len"] == ref["frozen_len"] and torch.equal(snap["tokens"], ref["tokens"])
            for (k, v), (rk, rv) in zip(snap["kv"], ref["kv"]):
                torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)
    return model


@pytest.mark.parametrize("attention", ["bidirectional", "block"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mdm_decoders_with_cuda_graphs_decode_as_without(case, attention):
    check_static_equals_eager(CASES[case], attention)


def test_freecache_with_cuda_graphs_freezes_the_same_kv():
    """The K/V FreeCache freezes are compared in the test above; here: there are some to compare."""
    decoder = decode({**CASES["freecache_refresh"], "max_new_tokens": L, "block_size": B, "cuda_graphs": True},
                     mdm_model("block", block=B), PROMPTS[0], snapshots=True)[1]
    assert len(decoder.kv_snapshots) == L // B  # the prompt, then every finished block but the last


@pytest.mark.parametrize("case", sorted(GUIDED))
def test_guided_with_cuda_graphs_decodes_as_without(guide_dir, case):  # noqa: F811
    guide = load_guide(guide_dir)
    check_static_equals_eager({**GUIDED[case], "guide": str(guide_dir)}, "bidirectional", guide)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mdm_decoders_replay_graphs_and_decode_as_eager_on_cuda():
    """On CUDA the static steps are captured graphs; the MDM decoders still decode as eagerly (fp32)."""
    model = mdm_model("block", block=B).to("cuda")
    for case in ("lowconf", "threshold_prefix_cache", "freecache_refresh", "wino"):
        cfg = {**CASES[case], "max_new_tokens": L, "block_size": B}
        for prompt in PROMPTS:
            eager = decode(cfg, model, prompt)[0]
            got = decode({**cfg, "cuda_graphs": True}, model, prompt)[0]
            assert got.tokens == eager.tokens and got.forwards == eager.forwards, (case, prompt)
    assert all(step.graph is not None for step in StepsPool._static[model]._steps.values())
