"""COVER decoder (``decoder=cover``): the step rules on hand-built tables, the revision counters on a
scripted decision sequence, the ``override=false`` decode against a slow reference written here
(eager attention with ``output_attentions``, masks built pair by pair, rules in plain Python), the
override forward against the plain forward it must reproduce, valid outputs with and without the
override, the attention restored after a run, named errors."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from pardec.common.errors import ConfigError
from pardec.inference.decoders.ar import ARDecoder, ARDecoderConfig
from pardec.inference.decoders.cover import (
    KEEP,
    REMASK,
    REPLACE,
    RevisionLog,
    cap_remasks,
    draft,
    seed_count,
    seed_scores,
    seed_signals,
    select_seeds,
    verify,
)
from pardec.inference.decoders.mdm_common import BlockRun, mdm_info
from pardec.inference.decoders.registry import build_decoder
from pardec.models.kv_override import KV_OVERRIDE, OTHERS, VERIFIERS
from tests.conftest import tiny_model
from tests.test_mdm_decoders import (
    EOS,
    MASK,
    PROMPTS,
    VOCAB,
    committed_answer,
    decoded_up_to_eos,
    mdm_model,
    mdm_tokenizer,
    without_mask,
)

torch.set_num_threads(1)

L, B = 12, 4


# -- step rules on hand-built tables -----------------------------------------------------------------


def test_draft_threshold_budget_and_top1():
    conf = torch.tensor([0.95, 0.5, 0.85, 0.99, 0.81, 0.80, 0.2])
    masked = torch.tensor([True, True, True, False, True, True, True])
    # > 0.8 strictly among masked: 0 (0.95), 2 (0.85), 4 (0.81); position 3 is decoded, 5 is not > 0.8
    assert draft(conf, masked, 0.8, budget=15) == [0, 2, 4]
    assert draft(conf, masked, 0.8, budget=2) == [0, 2]  # the two most confident
    assert draft(conf, masked, 0.8, budget=1) == [0]
    # nothing over the threshold: the most confident masked one alone
    assert draft(conf, masked, 0.96, budget=15) == [0]
    assert draft(torch.tensor([0.1, 0.3, 0.2]), torch.tensor([True, False, True]), 0.9, 5) == [2]
    assert draft(conf, torch.zeros(7, dtype=torch.bool), 0.8, 15) == []


def one_hot_rows(rows: list[dict[int, float]], vocab: int = 6) -> torch.Tensor:
    """Probability rows: the given entries, the rest of the mass spread over the other tokens."""
    out = torch.zeros(len(rows), vocab)
    for k, row in enumerate(rows):
        rest = 1 - sum(row.values())
        others = [v for v in range(vocab) if v not in row]
        for v in others:
            out[k, v] = rest / len(others)
        for v, p in row.items():
            out[k, v] = p
    return out


def test_keep_replace_remask():
    probs = one_hot_rows([
        {2: 0.6},  # current 2 is the argmax: Keep (even below the threshold)
        {4: 0.9, 1: 0.05},  # current 1, argmax 4 with 0.9 > 0.75: Replace by 4
        {4: 0.7, 1: 0.2},  # current 1, argmax 4 with 0.7 <= 0.75: ReMask
        {3: 0.75, 5: 0.1},  # argmax 3 at exactly the threshold (strict >; 0.75 is exact in fp32): ReMask
    ])
    decisions = verify([2, 1, 1, 5], probs, 0.75)
    assert decisions == [(KEEP, 2), (REPLACE, 4), (REMASK, -1), (REMASK, -1)]


def test_remask_cap_keeps_net_progress_positive():
    decisions = [(REMASK, -1), (KEEP, 7), (REMASK, -1), (REMASK, -1), (REPLACE, 3)]
    current = [10, 7, 11, 12, 9]
    current_prob = [0.30, 0.9, 0.05, 0.20, 0.1]
    # 3 drafted: at most 2 ReMasks, the two least supported current tokens (prob 0.05, 0.20)
    out, capped = cap_remasks(decisions, current, current_prob, n_drafted=3)
    assert out == [(KEEP, 10), (KEEP, 7), (REMASK, -1), (REMASK, -1), (REPLACE, 3)] and capped == 1
    # 1 drafted: no ReMask at all
    out, capped = cap_remasks(decisions, current, current_prob, n_drafted=1)
    assert [d for d, _ in out] == [KEEP, KEEP, KEEP, KEEP, REPLACE] and capped == 3
    # enough drafts: nothing capped
    out, capped = cap_remasks(decisions, current, current_prob, n_drafted=4)
    assert out == decisions and capped == 0


@pytest.mark.parametrize("shift", [0, 1])
def test_seed_signals_read_the_right_rows(shift):
    n = 5
    attention = torch.arange(n * n, dtype=torch.float32).reshape(n, n)  # A[q, k] = 5q + k
    masked = torch.tensor([False, False, False, True, True])
    drafted = torch.tensor([False, True, True, False, False])
    d_in, d_out = seed_signals(attention, masked, drafted, shift)
    rows = [3 - shift, 4 - shift]  # the rows predicting the masked positions 3 and 4
    assert d_in.tolist() == [sum(5 * r + j for r in rows) for j in range(n)]
    assert d_out.tolist() == [(5 * j + 1) + (5 * j + 2) for j in range(n)]


def test_seed_count_and_selection():
    # 6 pool scores, mean 1.5; above it: 2.0, 3.0, 4.0 -> m = 3, ceil(sqrt(3)) = 2
    scores = torch.tensor([0.0, 1.0, 4.0, 3.0, 0.0, 2.0, 9.0])
    pool = torch.tensor([True, True, True, True, True, True, False])  # index 6 is still masked
    assert seed_count(scores[pool]) == 2
    eligible = torch.ones(7, dtype=torch.bool)
    assert select_seeds(scores, pool, eligible) == [2, 3]  # never the masked index 6
    eligible[2] = False  # last step's seed, or at its revision budget
    assert select_seeds(scores, pool, eligible) == [3, 5]
    # m = 4: ceil(sqrt(4)) = 2 exactly (no float round-up to 3)
    four = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0, 0.0])
    assert seed_count(four) == 2
    # all equal: nothing above the mean, no seeds
    assert select_seeds(torch.ones(4), torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)) == []
    # fewer eligible than the count
    only = torch.tensor([False, False, False, True, False, False, False])
    assert select_seeds(scores, pool, only) == [3]
    assert torch.allclose(seed_scores(torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([3.0])),
                          torch.tensor([1.0]))  # 2 * (1 + 1) / (1 + 3)


def test_revision_counters_on_a_scripted_sequence():
    log = RevisionLog()
    # position 5: A -> remask -> A again (flip-flop, not effective)
    log.unmask(5, 1)
    log.remask(5, 1)
    log.unmask(5, 1)
    # position 6: B -> remask -> C (effective, no flip-flop)
    log.unmask(6, 2)
    log.remask(6, 2)
    log.unmask(6, 3)
    # position 7: D -> replace by E -> replace by D: the final token is D, so the D->E replace is not
    # effective (its removed token is the final one) and the E->D one is
    log.unmask(7, 4)
    log.replace(7, 4, 5)
    log.replace(7, 5, 4)
    # position 8: F -> replace G -> remask -> G restored (a flip-flop of G; replace F->G effective)
    log.unmask(8, 6)
    log.replace(8, 6, 7)
    log.remask(8, 7)
    log.unmask(8, 7)
    # position 9: remasked, never decoded again (EOS stop): a revision, not effective
    log.unmask(9, 8)
    log.remask(9, 8)
    final = [0] * 5 + [1, 3, 4, 7, MASK]
    summary = log.summary(final, MASK)
    assert summary == {"revisions": 7, "remasks": 4, "replaces": 3, "flip_flops": 2, "effective_revisions": 3}
    assert dict(log.per_position) == {5: 1, 6: 1, 7: 2, 8: 2, 9: 1}


# -- the decode against a slow reference (override=false) --------------------------------------------


def eager_forward(model, x: list[int], prompt_len: int, attention: str, attn_block: int | None):
    """Logits [n, V] (``<|mask|>`` excluded) and the last layer's head-averaged attention [n, n] with
    the eager backend and a mask built pair by pair."""
    n = len(x)
    blocks = [0 if p < prompt_len else 1 + (p - prompt_len) // (attn_block or 1) for p in range(n)]
    mask = torch.zeros(1, 1, n, n)
    for i in range(n):
        for j in range(n):
            if attention == "block" and blocks[j] > blocks[i]:
                mask[0, 0, i, j] = torch.finfo(torch.float32).min
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([x]), position_ids=torch.arange(n)[None], attention_mask=mask,
                        output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return without_mask(out.logits[0]), out.attentions[-1][0].mean(0)


TWO_PASS = "pardec_test_cover_two_pass"


class TwoPassState:
    """What the explicit attention below needs and records: seeds, the K/V injected at them and for
    which rows (``verifiers_only``: the seed's verifying row only, else every other row)."""

    def __init__(self, seeds: list[int], cached: dict | None, last_layer: int, verifiers_only: bool = False):
        self.seeds, self.cached, self.last_layer = seeds, cached, last_layer
        self.verifiers_only = verifiers_only
        self.recorded: dict = {}
        self.attention = None


def two_pass_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, two_pass=None, **kw):
    """Row by row: every seed column holds the cached K/V, except for the row verifying it (seed - 1),
    which sees the seed's K/V of this forward (``verifiers_only``: the other way round); plain
    softmax attention (no closed form)."""
    layer, state = module.layer_idx, two_pass
    state.recorded[layer] = (key, value)
    rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(rep, 1)[0].double(), value.repeat_interleave(rep, 1)[0].double()  # [h, n, d]
    q = query[0].double()  # [h, n, d]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, probs = torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float64)
    for r in range(q.shape[1]):
        keys, values = k.clone(), v.clone()
        for j in state.seeds:
            if state.cached is not None and (r == j - 1) == state.verifiers_only:
                ck, cv = state.cached[layer]
                keys[:, j] = ck.repeat_interleave(rep, 1)[0, :, j].double()
                values[:, j] = cv.repeat_interleave(rep, 1)[0, :, j].double()
        scores = (keys @ q[:, r, :, None])[..., 0] * scale + attention_mask[0, 0, r].double()  # [h, n]
        w = torch.softmax(scores, -1)
        out[:, r] = (w[..., None] * values).sum(1)
        probs[:, r] = w
    if layer == state.last_layer:
        state.attention = probs.mean(0).float()
    return out.transpose(0, 1)[None].to(query.dtype).contiguous(), None


def two_pass_forward(model, x, prompt_len, attention, attn_block, seeds, cached, verifiers_only=False):
    """Logits [n, V] (``<|mask|>`` excluded), the last layer's attention [n, n] and this forward's K/V,
    under the explicit override attention (the mask built pair by pair as in :func:`eager_forward`)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TWO_PASS, two_pass_attention)
    n = len(x)
    blocks = [0 if p < prompt_len else 1 + (p - prompt_len) // (attn_block or 1) for p in range(n)]
    mask = torch.zeros(1, 1, n, n)
    for i in range(n):
        for j in range(n):
            if attention == "block" and blocks[j] > blocks[i]:
                mask[0, 0, i, j] = torch.finfo(torch.float32).min
    state = TwoPassState(seeds, cached, model.config.num_hidden_layers - 1, verifiers_only)
    previous = model.config._attn_implementation
    model.set_attn_implementation(TWO_PASS)
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([x]), position_ids=torch.arange(n)[None], attention_mask=mask,
                           two_pass=state).logits[0]
    finally:
        model.set_attn_implementation(previous)
    return without_mask(logits), state.attention, state.recorded


def reference_cover(model, prompt, length, block, tau, budget, max_rev, attention, attn_block=None, eos=EOS,
                    override=False, seed_input="mask"):
    """COVER written out in plain Python; with ``override`` the forwards use the explicit row-by-row
    override attention above, without it the eager backend on the masked input. ``seed_input=token``:
    the seeds keep their tokens and their verifying rows see, per layer, the seed column's K/V from
    the last forward that fed that position a mask (kept position by position)."""
    x = list(prompt) + [MASK] * length
    p_len, n, forwards = len(prompt), len(prompt) + length, 0
    revisions: dict[int, int] = defaultdict(int)
    events = 0
    recorded = None
    token_input = override and seed_input == "token"
    mask_columns: dict[int, dict] = {}  # position -> layer -> (k [h_kv, d], v [h_kv, d]) when last fed a mask

    for b in range(length // block):
        s = p_len + b * block
        seeds: list[int] = []
        while MASK in x[s : s + block]:
            fed = [MASK if i in seeds and not token_input else t for i, t in enumerate(x)]
            if token_input:
                cached = None
                if seeds:
                    cached = {layer: tuple(torch.zeros_like(t) for t in kv) for layer, kv in recorded.items()}
                    for j in seeds:
                        for layer, (ck, cv) in mask_columns[j].items():
                            cached[layer][0][0, :, j], cached[layer][1][0, :, j] = ck, cv
                logits, attn, recorded = two_pass_forward(model, fed, p_len, attention, attn_block, seeds, cached,
                                                          verifiers_only=True)
                for j in (i for i, t in enumerate(fed) if t == MASK):
                    mask_columns[j] = {layer: (k[0, :, j], v[0, :, j]) for layer, (k, v) in recorded.items()}
            elif override:
                logits, attn, recorded = two_pass_forward(model, fed, p_len, attention, attn_block, seeds,
                                                          recorded if seeds else None)
            else:
                logits, attn = eager_forward(model, fed, p_len, attention, attn_block)
            forwards += 1
            probs = {j: torch.softmax(logits[j - 1].float(), -1) for j in range(s, s + block)}
            conf = {j: float(probs[j].max()) for j in probs}
            masked = [j for j in range(s, s + block) if x[j] == MASK]
            over = sorted((j for j in masked if conf[j] > tau), key=lambda j: (-conf[j], j))[:budget]
            drafted = sorted(set(over) | {max(masked, key=lambda j: (conf[j], -j))})
            remask, replace = [], {}
            for j in seeds:
                y = int(probs[j].argmax())
                if y == x[j]:
                    continue
                if conf[j] > tau:
                    replace[j] = y
                else:
                    remask.append(j)
            remask.sort(key=lambda j: float(probs[j][x[j]]))
            remask = remask[: max(len(drafted) - 1, 0)]
            for j in drafted:
                x[j] = int(probs[j].argmax())
            for j, y in replace.items():
                x[j] = y
                revisions[j] += 1
            for j in remask:
                x[j] = MASK
                revisions[j] += 1
            events += len(replace) + len(remask)
            if decoded_up_to_eos(x, p_len, eos) or MASK not in x[s : s + block]:
                break
            still = [q for q in range(n) if x[q] == MASK]
            pool = [j for j in range(s, s + block) if x[j] != MASK]
            score = {}
            for j in pool:
                u = -math.log(max(float(probs[j][x[j]]), 1e-12))
                d_in = sum(float(attn[q - 1, j]) for q in still)
                d_out = sum(float(attn[j, i]) for i in drafted)
                score[j] = u * (1 + d_in) / (1 + d_out)
            mean = sum(score.values()) / len(score)
            k = math.ceil(math.sqrt(sum(1 for v in score.values() if v > mean)) - 1e-9)
            eligible = [j for j in pool if j not in seeds and revisions[j] < max_rev]
            seeds = sorted(sorted(eligible, key=lambda j: (-score[j], j))[:k])
        if decoded_up_to_eos(x, p_len, eos):
            break
    out = committed_answer(x, p_len, eos)
    return out, forwards, events


def cover(cfg: dict, model, prompt, eos=EOS):
    decoder = build_decoder({"name": "cover", "max_new_tokens": L, "block_size": B, **cfg}, mdm_tokenizer())
    with decoder.prepare(model):
        return decoder.decode(model, [prompt], {eos}, [0])[0], decoder


CASES = [("bidirectional", None, 0.8, 15, 5), ("bidirectional", None, 0.5, 2, 1), ("block", B, 0.8, 15, 5),
         ("block", B, 0.9, 3, 2)]


def test_without_override_equals_the_reference():
    """Every case and prompt gives the reference's tokens, forwards and revision count; across them
    some revisions happen (the verification path is exercised)."""
    total_revisions = 0
    for attention, attn_block, tau, budget, max_rev in CASES:
        model = mdm_model(attention, block=attn_block)
        for prompt in PROMPTS:
            cfg = {"override": False, "draft_threshold": tau, "draft_budget": budget, "max_revisions": max_rev}
            result, _ = cover(cfg, model, prompt)
            tokens, forwards, events = reference_cover(model, prompt, L, B, tau, budget, max_rev, attention, attn_block)
            assert (result.tokens, result.forwards, result.stats["revisions"]) == (tokens, forwards, events), (
                attention, tau, prompt)
            total_revisions += events
    assert total_revisions > 0


@pytest.mark.parametrize("seed_input", ["mask", "token"])
def test_with_override_equals_the_explicit_reference(seed_input):
    """override=true: same tokens, forwards and revisions as the reference whose every layer runs
    the override as an explicit second pass per row (no closed form); the override changes the run
    relative to override=false somewhere (it is really applied)."""
    differs = False
    for attention, attn_block, tau, budget, max_rev in CASES[:3]:
        model = mdm_model(attention, block=attn_block)
        for prompt in PROMPTS:
            cfg = {"draft_threshold": tau, "draft_budget": budget, "max_revisions": max_rev, "seed_input": seed_input}
            result, _ = cover(cfg, model, prompt)
            tokens, forwards, events = reference_cover(model, prompt, L, B, tau, budget, max_rev, attention,
                                                       attn_block, override=True, seed_input=seed_input)
            assert (result.tokens, result.forwards, result.stats["revisions"]) == (tokens, forwards, events), (
                attention, tau, prompt)
            ablated, _ = cover({**cfg, "override": False}, model, prompt)
            differs |= (ablated.tokens, ablated.forwards, ablated.stats["revisions"]) != (tokens, forwards, events)
    assert differs


def cover_forward(decoder, run: BlockRun, seeds: list[int], cached, attention_layer: int):
    """One COVER forward of ``run``'s state (the decoder's own ``_forward``, eager), the attention kept
    from ``attention_layer``."""
    cached_for = VERIFIERS if decoder.token_input else OTHERS
    forward = decoder.forwards.get(run.model, run.full_mask, 1, attention_layer, cached_for)
    return decoder._forward(run, forward, seeds, cached)


@pytest.mark.parametrize("attention", ["bidirectional", "block"])
def test_override_forward_equals_the_explicit_two_pass_model_forward(attention):
    """A whole decoder forward (seed_input=mask; two layers, seeds masked, cache from a forward over another state):
    logits and the last layer's attention equal the explicit row-by-row reference."""
    model = mdm_model(attention, block=B)
    decoder = build_decoder({"name": "cover", "max_new_tokens": L, "block_size": B, "seed_input": "mask"},
                            mdm_tokenizer())
    prompt = PROMPTS[2]
    torch.manual_seed(1)
    with decoder.prepare(model), torch.no_grad():
        run = BlockRun(decoder, model, mdm_info(model), prompt, L, B, torch.device("cpu"))
        run.x[len(prompt): len(prompt) + 8] = torch.randint(3, VOCAB - 1, (8,))  # two blocks decoded
        _, previous, _ = cover_forward(decoder, run, [], None, 1)
        run.x[len(prompt) + 8] = 5  # the state moved on
        seeds = [len(prompt) + 4, len(prompt) + 6, len(prompt) + 7]
        logits, step, _ = cover_forward(decoder, run, seeds, previous.recorded, 1)
    n = run.x.numel()
    x = run.x.tolist()
    fed = [MASK if i in seeds else t for i, t in enumerate(x)]
    ref_logits, ref_attn, _ = two_pass_forward(model, fed, len(prompt), attention, B, seeds, previous.recorded)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step.attention[0], ref_attn, atol=1e-5, rtol=1e-5)
    assert step.attention.shape == (1, n, n)


# -- the override forward ---------------------------------------------------------------------------


def one_layer_mdm(attention: str):
    model = mdm_model(attention, block=B)
    small = tiny_model(VOCAB, "qwen3", num_hidden_layers=1)
    small.lm_head.weight = torch.nn.Parameter(small.lm_head.weight.detach() * 60.0)
    small.config.tie_word_embeddings = False
    small.config.pardec = dict(model.config.pardec)
    return small


@pytest.mark.parametrize("attention", ["bidirectional", "block"])
def test_override_forward_reproduces_the_plain_forward_off_the_verifying_rows(attention):
    """seed_input=mask: seeds masked in the input, their K/V taken from a forward over the *unmasked* sequence, one
    layer: every query row except the seeds' own rows and their verifying rows (i - 1, the logit
    shift) sees exactly the K/V of the unmasked forward, so its logits equal it; the verifying rows
    differ (they see the seed's mask K/V). Without override (override=false) the other rows change
    too. (With more layers the identity does not hold under a logit shift: the verifying row i - 1 is
    a non-seed position, and its leave-one-out hidden state feeds its own K/V to every query in the
    next layer.)"""
    model = one_layer_mdm(attention)
    decoder = build_decoder({"name": "cover", "max_new_tokens": L, "block_size": B, "seed_input": "mask"},
                            mdm_tokenizer())
    info = mdm_info(model)
    prompt = PROMPTS[2]
    torch.manual_seed(0)
    with decoder.prepare(model), torch.no_grad():
        run = BlockRun(decoder, model, info, prompt, L, B, torch.device("cpu"))
        run.x[len(prompt):] = torch.randint(3, VOCAB - 1, (L,))  # a fully decoded answer
        plain_logits, plain, _ = cover_forward(decoder, run, [], None, 0)
        seeds = [len(prompt) + 1, len(prompt) + 6]
        logits, step, _ = cover_forward(decoder, run, seeds, plain.recorded, 0)
        decoder.cfg.override = False
        ablated, _, _ = cover_forward(decoder, run, seeds, plain.recorded, 0)
    verifying = {j - 1 for j in seeds}
    others = [r for r in range(run.x.numel()) if r not in verifying and r not in seeds]
    torch.testing.assert_close(logits[others], plain_logits[others], atol=1e-5, rtol=1e-5)
    for r in verifying:
        assert not torch.allclose(logits[r], plain_logits[r], atol=1e-3)
    assert not torch.allclose(ablated[others], plain_logits[others], atol=1e-3)
    assert step.attention.shape == (1, run.x.numel(), run.x.numel())


@pytest.mark.parametrize("override", [True, False])
@pytest.mark.parametrize("attention", ["bidirectional", "block"])
def test_full_decode_gives_valid_outputs(override, attention):
    model = mdm_model(attention, block=B)
    stats_seen = []
    for tau in (0.8, 0.5):
        for prompt in PROMPTS:
            result, decoder = cover({"override": override, "draft_threshold": tau}, model, prompt, eos=-1)
            assert len(result.tokens) == L and MASK not in result.tokens and result.committed == L
            assert not result.hit_eos
            assert L / B <= result.forwards <= L  # at least one position gained per step
            st = result.stats
            assert st["steps"] == result.forwards == st["dlm_forwards"] and st["override"] is override
            assert st["revisions"] == st["remasks"] + st["replaces"]
            assert 0 <= st["effective_revisions"] <= st["revisions"] and st["flip_flops"] <= st["remasks"]
            assert st["tokens_per_step"] == pytest.approx(L / result.forwards)
            assert 0 <= st["fresh_seeds"] <= st["seeds"] and st["revisions"] <= st["seeds"]
            stats_seen.append({"stats": st, "committed": result.committed})
    summary = decoder.summarize(stats_seen)
    assert summary["steps_per_sample"] == pytest.approx(sum(r["stats"]["steps"] for r in stats_seen) / len(stats_seen))
    assert summary["tokens_per_step"] == pytest.approx(summary["tpf_dlm"])
    assert 0 <= summary["effective_revision_ratio"] <= 1


@pytest.mark.parametrize("override", [True, False])
def test_decoding_stops_at_eos(override):
    model = mdm_model("bidirectional")
    full, _ = cover({"override": override}, model, PROMPTS[0], eos=-1)
    eos = full.tokens[5]  # a token the run emits: call it EOS
    result, _ = cover({"override": override}, model, PROMPTS[0], eos=eos)
    assert result.hit_eos and result.tokens[-1] == eos and eos not in result.tokens[:-1]
    assert MASK not in result.tokens and result.forwards <= full.forwards


def test_non_revocable_mdm_decoders_report_zero_revisions():
    model = mdm_model("bidirectional")
    decoder = build_decoder({"name": "mdm_threshold", "max_new_tokens": L, "block_size": B, "threshold": 0.7,
                             "prefix_cache": False}, mdm_tokenizer())
    with decoder.prepare(model):
        result = decoder.decode(model, [PROMPTS[0]], {-1}, [0])[0]
    st = result.stats
    assert st["steps"] == result.forwards and st["tokens_per_step"] == pytest.approx(L / result.forwards)
    assert (st["revisions"], st["flip_flops"], st["effective_revisions"]) == (0, 0, 0)
    summary = decoder.summarize([{"stats": st, "committed": result.committed}])
    assert summary["revisions_per_sample"] == 0 and summary["steps_per_sample"] == result.forwards


# -- lifecycle and errors ---------------------------------------------------------------------------


def ar_greedy(model, prompt):
    decoder = ARDecoder(ARDecoderConfig(max_new_tokens=8), mdm_tokenizer())
    return decoder.decode(model, [prompt], {EOS}, [0])[0].tokens


def test_attention_is_restored_after_a_decode_and_after_an_error():
    model = mdm_model("bidirectional")
    before = ar_greedy(model, PROMPTS[0])
    decoder = build_decoder({"name": "cover", "max_new_tokens": L, "block_size": B, "seed_input": "mask"},
                            mdm_tokenizer())
    with decoder.prepare(model):
        assert model.config._attn_implementation == KV_OVERRIDE
        assert not any(m.is_causal for m in model.modules() if hasattr(m, "is_causal"))
        decoder.decode(model, [PROMPTS[0]], {EOS}, [0])
    assert model.config._attn_implementation == "sdpa"
    assert all(m.is_causal for m in model.modules() if hasattr(m, "is_causal"))
    assert ar_greedy(model, PROMPTS[0]) == before
    with pytest.raises(RuntimeError, match="boom"), decoder.prepare(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa" and ar_greedy(model, PROMPTS[0]) == before
    # decode() outside prepare installs and removes the attention itself
    outside = decoder.decode(model, [PROMPTS[0]], {EOS}, [0])[0]
    assert MASK not in outside.tokens and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("key,value", [("draft_threshold", 1.0), ("draft_budget", 0), ("max_revisions", -1),
                                       ("freecache", True), ("seed_input", "tokens")])
def test_bad_options_are_named_errors(key, value):
    with pytest.raises(ConfigError, match=f"decoder.{key}"):
        build_decoder({"name": "cover", key: value}, mdm_tokenizer())


def test_token_input_keeps_every_row_but_the_verifying_ones():
    """seed_input=token, one layer: the seeds hold their tokens, so every row except the verifying
    rows (i - 1) equals the plain forward exactly, the seed's own row (which predicts i + 1) included;
    each verifying row equals the forward over the input with that seed masked, on the row's
    prediction (one layer: the seed column's mask K/V are those of that forward)."""
    model = one_layer_mdm("bidirectional")
    decoder = build_decoder({"name": "cover", "max_new_tokens": L, "block_size": B, "seed_input": "token"},
                            mdm_tokenizer())
    prompt = PROMPTS[2]
    torch.manual_seed(3)
    seeds = [len(prompt) + 1, len(prompt) + 6]
    with decoder.prepare(model), torch.no_grad():
        run = BlockRun(decoder, model, mdm_info(model), prompt, L, B, torch.device("cpu"))
        run.x[len(prompt):] = torch.randint(3, VOCAB - 1, (L,))
        plain_logits, _, _ = cover_forward(decoder, run, [], None, 0)
        masked_runs = {}
        for j in seeds:  # each seed masked alone: its column's mask-derived K/V
            saved = int(run.x[j])
            run.x[j] = MASK
            masked_runs[j] = cover_forward(decoder, run, [], None, 0)
            run.x[j] = saved
        memory = {0: tuple(t.clone() for t in masked_runs[seeds[0]][1].recorded[0])}
        for t_mem, t_j in zip(memory[0], masked_runs[seeds[1]][1].recorded[0]):
            t_mem[:, :, seeds[1]] = t_j[:, :, seeds[1]]
        logits, _, fed_masks = cover_forward(decoder, run, seeds, memory, 0)
    assert not fed_masks.any()  # the seeds were fed their tokens
    verifying = {j - 1 for j in seeds}
    others = [r for r in range(run.x.numel()) if r not in verifying]
    torch.testing.assert_close(logits[others], plain_logits[others], atol=1e-5, rtol=1e-5)
    for j in seeds:
        torch.testing.assert_close(logits[j - 1], masked_runs[j][0][j - 1], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(logits[j - 1], plain_logits[j - 1], atol=1e-3)
