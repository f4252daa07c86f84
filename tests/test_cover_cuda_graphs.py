"""COVER with ``cuda_graphs`` (pardec.inference.decoders.override_forward): from the static buffers
(run eagerly on CPU, the override always on, all-false seeds where the eager path has none) COVER
decodes what it decodes without them, token for token with the same forwards and statistics, in
both attentions, with and without the override, with either seed input; every forward reads the
static buffers; one static forward per sequence length and settings is kept (at most ``KEPT``, the oldest dropped). The
CUDA test checks the captured graphs."""

from __future__ import annotations

import pytest
import torch

from pardec.inference.decoders import override_forward
from pardec.inference.decoders.override_forward import OverrideForwards, StaticOverrideForward
from tests.test_cover_decoder import B, cover
from tests.test_mdm_decoders import PROMPTS, mdm_model

torch.set_num_threads(1)

# (attention, attention block, the decoder's settings): low thresholds and budgets so that seeds are
# verified, replaced and re-masked.
CASES = {
    "bidirectional_token": ("bidirectional", None, {"draft_threshold": 0.5, "draft_budget": 2, "max_revisions": 2}),
    "bidirectional_mask": ("bidirectional", None, {"draft_threshold": 0.5, "draft_budget": 2, "seed_input": "mask"}),
    "bidirectional_no_override": ("bidirectional", None, {"draft_threshold": 0.5, "override": False}),
    "block_token": ("block", B, {"draft_threshold": 0.8}),
    "block_mask": ("block", B, {"draft_threshold": 0.9, "draft_budget": 3, "seed_input": "mask"}),
}


def static_masks(model) -> list[bool]:
    """Appends, per forward of ``model``, whether its mask is a kept static forward's buffer."""
    seen: list[bool] = []

    def hook(module, args, kwargs):
        kept = OverrideForwards._static.get(module, {}).values()
        seen.append(any(kwargs["attention_mask"] is forward.mask for forward in kept))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_cover_with_cuda_graphs_decodes_as_without(case):
    attention, block, cfg = CASES[case]
    model = mdm_model(attention, block=block)
    seen = static_masks(model)
    seeds = 0
    for prompt in PROMPTS:
        eager = cover(cfg, model, prompt)[0]
        seen.clear()
        before = set(OverrideForwards._static.get(model, {}))
        got = cover({**cfg, "cuda_graphs": True}, model, prompt)[0]
        assert got.tokens == eager.tokens and got.forwards == eager.forwards, (case, prompt)
        assert got.stats == eager.stats, (case, prompt)
        built = len(set(OverrideForwards._static[model]) - before)  # a new length: one forward builds its buffers
        assert seen == [False] * built + [True] * got.forwards, "a forward bypassed the static buffers"
        seeds += got.stats["seeds"]
    assert seeds > 0  # seeds were verified: the override path (or the ablation's masking) ran
    lengths = {len(prompt) for prompt in PROMPTS}
    assert len(OverrideForwards._static[model]) == len(lengths)  # one static forward per sequence length


def test_at_most_kept_static_forwards_per_model(monkeypatch):
    monkeypatch.setattr(override_forward, "KEPT", 2)
    model = mdm_model("bidirectional")
    forwards = OverrideForwards(cuda_graphs=True)
    built = {}
    for n in (5, 6, 6, 7, 5):
        mask = torch.full((1, 1, n, n), float(n))
        forward = forwards.get(model, mask, 1, 0, "others")
        assert isinstance(forward, StaticOverrideForward) and forward.ids.shape == (1, n)
        assert torch.equal(forward.mask, mask)  # this sequence's mask copied in
        built.setdefault(n, []).append(forward)
    assert built[6][0] is built[6][1]  # kept and reused
    assert built[5][0] is not built[5][1]  # dropped when 7 came (the oldest), built again
    assert [key[0] for key in OverrideForwards._static[model]] == [7, 5]
    assert forwards.get(model, torch.zeros(1, 1, 5, 5), 1, 0, "verifiers") is not built[5][1]  # other settings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cover_replays_graphs_and_decodes_as_eager_on_cuda():
    """On CUDA the static forwards are captured graphs; COVER still decodes as eagerly (fp32)."""
    for case in ("bidirectional_token", "bidirectional_mask", "block_token"):
        attention, block, cfg = CASES[case]
        model = mdm_model(attention, block=block).to("cuda")
        for prompt in PROMPTS:
            eager = cover(cfg, model, prompt)[0]
            got = cover({**cfg, "cuda_graphs": True}, model, prompt)[0]
            assert got.tokens == eager.tokens and got.forwards == eager.forwards, (case, prompt)
            assert got.stats == eager.stats, (case, prompt)
        assert all(forward.graph is not None for forward in OverrideForwards._static[model].values())
