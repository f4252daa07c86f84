"""No MDM decoder drafts, commits or replaces with ``<|mask|>``, however the model was loaded.

The models here come without ``pardec.inference.checkpoint.forbid_output_token`` (which
``load_checkpoint`` installs) and a hook on the output embeddings adds :data:`BOOST` to the mask id's
logit, so ``<|mask|>`` is every position's top prediction. A decoder that proposed it would write it
back, leave the position masked and draft it again at every step, without end: a forward-count bound
turns that into a failure. Reference: the same decode without the hook (the mask's logit is excluded
either way, so every other probability, and with them the decode, must be the same)."""

from __future__ import annotations

import pytest
import torch

from pardec.inference.decoders.registry import build_decoder
from tests.conftest import tiny_model, tiny_tokenizer
from tests.test_mdm_decoders import FILLERS, MASK, PROMPTS, VOCAB, mdm_model, mdm_tokenizer

torch.set_num_threads(1)

L, B = 12, 4
BOOST = 1e4  # added to <|mask|>'s logit: far above every other logit of the tiny models
MAX_FORWARDS = 8 * L  # per decode; the decoders need at most L (WINO: 4 x B per block) without the bug

DECODERS = {
    "mdm_lowconf": {"name": "mdm_lowconf"},
    "mdm_threshold": {"name": "mdm_threshold", "threshold": 0.7},
    "mdm_threshold freecache": {"name": "mdm_threshold", "threshold": 0.7, "freecache": True},
    "cover": {"name": "cover"},
    "cover seed_input=mask": {"name": "cover", "seed_input": "mask", "draft_threshold": 0.5},
    "cover override=false": {"name": "cover", "override": False},
    "wino": {"name": "wino"},
    "saber": {"name": "saber"},
    "mdm_guided": {"name": "mdm_guided", "commit": "assisted"},
    # the static steps (cuda_graphs; run eagerly on CPU): the DLM's and the guide's forwards over the static cache
    "mdm_lowconf cuda_graphs": {"name": "mdm_lowconf", "cuda_graphs": True},
    "mdm_threshold freecache cuda_graphs": {"name": "mdm_threshold", "threshold": 0.7, "freecache": True,
                                            "cuda_graphs": True},
    "wino cuda_graphs": {"name": "wino", "cuda_graphs": True},
    "mdm_guided cuda_graphs": {"name": "mdm_guided", "commit": "assisted", "cuda_graphs": True},
}


def prefer_mask(model):
    """Make ``<|mask|>`` the model's top prediction at every position (a hook on its output embeddings)."""

    def hook(module, args, logits):
        logits = logits.clone()
        logits[..., MASK] += BOOST
        return logits

    return model.get_output_embeddings().register_forward_hook(hook)


def bound_forwards(model, limit: int):
    """Fail instead of hanging: a forward past ``limit`` raises."""
    count = [0]

    def hook(module, args):
        count[0] += 1
        if count[0] > limit:
            raise RuntimeError(f"more than {limit} forwards: the decode does not terminate")

    return model.register_forward_pre_hook(hook)


def run(cfg: dict, model, prompt, guide=None):
    decoder = build_decoder({"max_new_tokens": L, "block_size": B, **cfg}, mdm_tokenizer())
    if guide is not None:
        decoder.use_auxiliary({"guide": guide})
    with decoder.prepare(model):
        return decoder.decode(model, [prompt], {-1}, [0])[0]


def boosted_and_plain(cfg: dict, model, boosted, prompt, guide=None):
    """The decode with ``boosted`` preferring ``<|mask|>``, then without; both bounded in forwards."""
    bounds = [bound_forwards(m, MAX_FORWARDS) for m in [model] + ([guide] if guide is not None else [])]
    try:
        handle = prefer_mask(boosted)
        try:
            with_boost = run(cfg, model, prompt, guide)
        finally:
            handle.remove()
    finally:
        for bound in bounds:
            bound.remove()
    return with_boost, run(cfg, model, prompt, guide)


@pytest.fixture(scope="module")
def guide(tmp_path_factory):
    """An AR guide whose output has a row at the mask id (as a padded vocabulary would), though its
    tokenizer has no ``<|mask|>``."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("guide")
    tiny_model(VOCAB, "qwen3", seed=3).save_pretrained(path)
    tiny_tokenizer(FILLERS).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def check(with_boost, plain):
    assert MASK not in with_boost.tokens and len(with_boost.tokens) == L == with_boost.committed
    assert (with_boost.tokens, with_boost.forwards) == (plain.tokens, plain.forwards)
    assert with_boost.stats.get("revisions") == plain.stats.get("revisions")


@pytest.mark.parametrize("attention", ["bidirectional", "block"])
@pytest.mark.parametrize("case", sorted(DECODERS))
def test_a_model_that_prefers_the_mask_still_decodes(case, attention, guide):
    model = mdm_model(attention, block=B)
    cfg = dict(DECODERS[case])
    if cfg["name"] == "mdm_guided":
        cfg["guide"] = guide.config._name_or_path
    else:
        guide = None
    for prompt in PROMPTS[:2]:
        check(*boosted_and_plain(cfg, model, model, prompt, guide))


@pytest.mark.parametrize("acceptance", ["strict", "relaxed"])
def test_a_guide_that_prefers_the_mask_id_is_not_committed(guide, acceptance):
    """commit=shifted commits the guide's top token where a draft is rejected; the guide's row at the
    mask id must not be that token."""
    model = mdm_model("bidirectional")
    cfg = {"name": "mdm_guided", "guide": guide.config._name_or_path, "commit": "shifted", "acceptance": acceptance}
    for prompt in PROMPTS[:2]:
        check(*boosted_and_plain(cfg, model, guide, prompt, guide))
