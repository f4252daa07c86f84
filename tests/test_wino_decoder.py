"""WINO decoder (``decoder=wino``): draft/re-mask rules on hand-built tables; the shadow rows leave
the real rows' outputs unchanged and never see the token they verify; the decode equals a slow
reference written here (extended sequence and mask built pair by pair, eager attention, rules in
plain Python); valid outputs, EOS stop, named errors."""

from __future__ import annotations

import pytest
import torch

from pardec.common.errors import ConfigError
from pardec.inference.decoders.mdm_common import BlockRun, mdm_info
from pardec.inference.decoders.registry import build_decoder
from pardec.inference.decoders.wino import max_accept, wino_draft, wino_remask
from tests.test_cover_decoder import one_layer_mdm
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


def test_max_accept_schedule():
    assert [max_accept(n) for n in (1, 7, 8, 20, 28, 29, 64)] == [5, 5, 5, 14, 19, 20, 20]


def test_wino_draft():
    conf = torch.tensor([0.65, 0.59, 0.9, 0.99, 0.61, 0.7, 0.2, 0.8])
    masked = torch.tensor([True, True, True, False, True, True, True, True])
    # > 0.6 among masked: 0, 2, 4, 5, 7 (3 is decoded); 7 masked -> cap 5: all five
    assert wino_draft(conf, masked, 0.6) == [0, 2, 4, 5, 7]
    many = torch.linspace(0.70, 0.99, 12)
    assert wino_draft(many, torch.ones(12, dtype=torch.bool), 0.6) == list(range(4, 12))  # cap int(8.4) = 8
    assert wino_draft(conf, masked, 0.95) == [2]  # nothing over: the top-1


def test_wino_remask():
    conf_back = torch.tensor([0.95, 0.5, 0.89, 0.3, 0.99, 0.1])
    verified = torch.tensor([True, True, True, True, True, False])  # 5 was masked before the step
    assert wino_remask(conf_back, verified, 0.9, n_drafted=2, last_accept=30) == [1, 2, 3]
    assert wino_remask(conf_back, verified, 0.9, n_drafted=1, last_accept=30) == []  # one draft: no re-mask
    # 3 qualify >= last_accept 3: only the 2 least confident
    assert wino_remask(conf_back, verified, 0.9, n_drafted=4, last_accept=3) == [1, 3]
    assert wino_remask(conf_back, verified, 0.9, n_drafted=4, last_accept=4) == [1, 2, 3]


def test_shadow_rows_leave_real_rows_unchanged_and_hide_the_verified_token():
    """Real rows: equal to a plain forward. Shadow row of j (one layer, so nothing reaches it
    indirectly): unchanged when x[j] changes, changed when x[j-1] (its own token) changes."""
    model = one_layer_mdm("bidirectional")
    decoder = build_decoder({"name": "wino", "max_new_tokens": L, "block_size": B}, mdm_tokenizer())
    prompt = PROMPTS[2]
    torch.manual_seed(0)
    with decoder.prepare(model), torch.no_grad():
        run = BlockRun(decoder, model, mdm_info(model), prompt, L, B, torch.device("cpu"))
        run.x[len(prompt):] = torch.randint(3, VOCAB - 1, (L,))
        s, e = run.span(1)
        real, shadow = decoder.shadow_forward(run, 1)
        n = run.x.numel()
        plain = without_mask(model(input_ids=run.x[None], position_ids=torch.arange(n)[None],
                                   attention_mask=run.full_mask).logits[0])
        j = s + 2
        run.x[j] = (run.x[j] + 1 - 3) % (VOCAB - 4) + 3
        _, shadow_j = decoder.shadow_forward(run, 1)
        run.x[j - 1] = (run.x[j - 1] + 1 - 3) % (VOCAB - 4) + 3
        _, shadow_j1 = decoder.shadow_forward(run, 1)
    torch.testing.assert_close(real, plain[s - 1 : e - 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shadow_j[2], shadow[2], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(shadow_j[1], shadow[1], atol=1e-4)  # row 1 verifies j - 1 and sees x[j]
    assert not torch.allclose(shadow_j1[2], shadow_j[2], atol=1e-4)


def eager_extended(model, x, prompt_len, s, block, attention, attn_block):
    """The extended sequence and its mask built pair by pair; logits [n + block, V] (eager, ``<|mask|>``
    excluded)."""
    n = len(x)
    blocks = [0 if p < prompt_len else 1 + (p - prompt_len) // (attn_block or 1) for p in range(n)]

    def sees(i, j):
        return not (attention == "block" and blocks[j] > blocks[i])

    ids = list(x) + [x[s + o - 1] for o in range(block)]
    pos = list(range(n)) + [s + o - 1 for o in range(block)]
    neg = torch.finfo(torch.float32).min
    mask = torch.full((1, 1, n + block, n + block), neg)
    for q in range(n + block):
        for k in range(n + block):
            if q < n and k < n:
                ok = sees(q, k)
            elif q >= n and k < n:
                row = s + (q - n) - 1
                ok = sees(row, k) and k != s + (q - n)
            else:
                ok = q == k
            if ok:
                mask[0, 0, q, k] = 0
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=mask)
    finally:
        model.set_attn_implementation(previous)
    return without_mask(out.logits[0])


def reference_wino(model, prompt, length, block, tau, tau_back, attention, attn_block=None, eos=EOS):
    x = list(prompt) + [MASK] * length
    p_len, forwards, remasks = len(prompt), 0, 0

    for b in range(length // block):
        s = p_len + b * block
        last = 30
        while MASK in x[s : s + block]:
            logits = eager_extended(model, x, p_len, s, block, attention, attn_block)
            n = len(x)
            forwards += 1
            probs = [torch.softmax(logits[s + o - 1].float(), -1) for o in range(block)]
            back = [torch.softmax(logits[n + o].float(), -1) for o in range(block)]
            masked = [o for o in range(block) if x[s + o] == MASK]
            conf = {o: float(probs[o].max()) for o in masked}
            over = sorted((o for o in masked if conf[o] > tau), key=lambda o: (-conf[o], o))
            cap = min(max(int(len(masked) * 0.7), 5), 20)
            drafted = over[:cap] if over else [max(masked, key=lambda o: (conf[o], -o))]
            low = []
            if len(drafted) > 1:
                decoded = [o for o in range(block) if x[s + o] != MASK]
                cb = {o: float(back[o][x[s + o]]) for o in decoded}
                low = [o for o in decoded if cb[o] < tau_back]
                if len(low) >= last:
                    low = sorted(decoded, key=lambda o: (cb[o], o))[: last - 1]
            for o in low:
                x[s + o] = MASK
            for o in drafted:
                x[s + o] = int(probs[o].argmax())
            remasks += len(low)
            last = len(drafted)
            if decoded_up_to_eos(x, p_len, eos):
                break
        if decoded_up_to_eos(x, p_len, eos):
            break
    out = committed_answer(x, p_len, eos)
    return out, forwards, remasks


def wino(cfg: dict, model, prompt, eos=EOS):
    decoder = build_decoder({"name": "wino", "max_new_tokens": L, "block_size": B, **cfg}, mdm_tokenizer())
    with decoder.prepare(model):
        return decoder.decode(model, [prompt], {eos}, [0])[0], decoder


def test_wino_equals_the_reference():
    total = 0
    for attention, attn_block, tau, back in [("bidirectional", None, 0.6, 0.9), ("bidirectional", None, 0.3, 0.95),
                                             ("block", B, 0.5, 0.9)]:
        model = mdm_model(attention, block=attn_block)
        for prompt in PROMPTS:
            result, _ = wino({"threshold": tau, "threshold_back": back}, model, prompt)
            tokens, forwards, remasks = reference_wino(model, prompt, L, B, tau, back, attention, attn_block)
            assert (result.tokens, result.forwards, result.stats["revisions"]) == (tokens, forwards, remasks), (
                attention, tau, prompt)
            assert result.stats["remask_stopped"] == 0
            total += remasks
    assert total > 0  # the narrow-out path is exercised


def test_wino_outputs_and_stats():
    model = mdm_model("bidirectional")
    records = []
    for prompt in PROMPTS:
        result, decoder = wino({"threshold": 0.3}, model, prompt, eos=-1)
        assert len(result.tokens) == L and MASK not in result.tokens
        st = result.stats
        assert st["revisions"] == st["remasks"] and st["replaces"] == 0
        assert 0 <= st["effective_revisions"] <= st["revisions"] and st["flip_flops"] <= st["remasks"]
        records.append({"stats": st, "committed": result.committed})
    summary = decoder.summarize(records)
    assert summary["tokens_per_step"] == pytest.approx(summary["tpf_dlm"])
    full, _ = wino({}, model, PROMPTS[0], eos=-1)
    eos = full.tokens[5]
    stopped, _ = wino({}, model, PROMPTS[0], eos=eos)
    assert stopped.hit_eos and stopped.tokens[-1] == eos and eos not in stopped.tokens[:-1]


def test_wino_named_errors():
    # a checkpoint that is not an MDM export: test_mdm_decoders.test_non_mdm_checkpoint_is_a_named_error
    for key, value in (("threshold", 1.5), ("threshold_back", -0.1), ("max_block_steps", 0), ("freecache", True)):
        with pytest.raises(ConfigError, match=f"decoder.{key}"):
            build_decoder({"name": "wino", key: value}, mdm_tokenizer())
