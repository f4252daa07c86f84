"""MDM decoders (LLaDA low-confidence, Fast-dLLM threshold, FreeCache, FlashDLM guided) against slow
step-by-step references written here (full recompute, no cache, masks built by loops), FreeCache's
frozen K/V against full forwards, guided shifted+strict against the guide's AR greedy, named errors."""

from __future__ import annotations

import math
from pathlib import Path

import datasets
import pytest
import torch
from transformers import DynamicCache

from pardec.common.constants import MASK_TOKEN
from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.kv_cache import cache_argument
from pardec.inference.decoders.ar import ARDecoder, ARDecoderConfig
from pardec.inference.decoders.registry import build_decoder
from pardec.inference.evaluate import evaluate
from tests.conftest import EVAL_ROWS, tiny_model, tiny_tokenizer

torch.set_num_threads(1)

VOCAB = 40
MASK = VOCAB - 1
EOS = 0
SHARPEN = 60.0
PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [9, 10, 11, 12, 13, 14, 15]]
FILLERS = tuple(f"w{i}" for i in range(VOCAB - 1 - len(tiny_tokenizer())))



def decoded_up_to_eos(x: list[int], p_len: int, eos: int) -> bool:
    """The reference decoders' stop rule: every answer position up to the first EOS is unmasked."""
    for t in x[p_len:]:
        if t == MASK:
            return False
        if t == eos:
            return True
    return False


def committed_answer(x: list[int], p_len: int, eos: int) -> list[int]:
    """The answer a reference decode committed: tokens up to the first mask, EOS included."""
    out = []
    for t in x[p_len:]:
        if t == MASK:
            break
        out.append(t)
        if t == eos:
            break
    return out

def mdm_tokenizer():
    tok = tiny_tokenizer(FILLERS + (MASK_TOKEN,))
    assert tok.convert_tokens_to_ids(MASK_TOKEN) == MASK and len(tok) == VOCAB
    return tok


def mdm_model(attention: str, block: int | None = None, seed: int = 0):
    """Tiny random MDM; its (untied) LM head is scaled up so confidences spread over (0, 1) and the
    threshold decoder commits one to several tokens per step."""
    model = tiny_model(VOCAB, "qwen3", seed=seed)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * SHARPEN)
    model.config.tie_word_embeddings = False
    model.config._attn_implementation = "sdpa"
    model.config.pardec = {"recipe": "mdm", "attention": attention, "logit_shift": True, "mask_token_id": MASK,
                           **({"attention_block_size": block} if block else {})}
    return model


# -- slow references ------------------------------------------------------------------------------


def without_mask(logits: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` as the MDM decoders read them: ``<|mask|>``'s logit -inf (a copy)."""
    logits = logits.clone()
    logits[..., MASK] = float("-inf")
    return logits


def full_logits(model, x: list[int], prompt_len: int, attention: str, attn_block: int | None) -> torch.Tensor:
    """One forward over the whole sequence, no cache; the mask built pair by pair; ``<|mask|>`` excluded."""
    n = len(x)
    blocks = [0 if p < prompt_len else 1 + (p - prompt_len) // (attn_block or 1) for p in range(n)]
    mask = torch.zeros(1, 1, n, n)
    for i in range(n):
        for j in range(n):
            if attention == "block" and blocks[j] > blocks[i]:
                mask[0, 0, i, j] = torch.finfo(torch.float32).min
    with torch.no_grad():
        out = model(input_ids=torch.tensor([x]), position_ids=torch.arange(n)[None], attention_mask=mask)
    return without_mask(out.logits[0])


def conf_and_token(row: torch.Tensor) -> tuple[float, int]:
    probs = torch.softmax(row.double(), -1)
    return float(probs.max()), int(probs.argmax())


def lowconf_rule(steps: int):
    def select(rows, masked, step, block):
        base, rem = divmod(block, steps)
        k = min(base + (1 if step < rem else 0), sum(masked))
        scored = sorted((-conf_and_token(rows[i])[0], i) for i in range(block) if masked[i])
        return {i: conf_and_token(rows[i])[1] for _, i in scored[:k]}
    return select


def threshold_rule(tau: float):
    def select(rows, masked, step, block):
        cand = [i for i in range(block) if masked[i]]
        best = max(cand, key=lambda i: conf_and_token(rows[i])[0])
        return {i: conf_and_token(rows[i])[1] for i in cand if i == best or conf_and_token(rows[i])[0] >= tau}
    return select


def guided_rule(guide, commit: str, acceptance: str, ratio: float = 0.5):
    def select(rows, masked, step, block, x, start):
        first = masked.index(True)
        drafts = [conf_and_token(rows[i])[1] for i in range(first, block)]
        m = start + first
        with torch.no_grad():  # the guide: a plain causal forward over the committed prefix + drafts
            g = torch.softmax(guide(input_ids=torch.tensor([x[:m] + drafts])).logits[0].double(), -1)
        n = 0
        for k, d in enumerate(drafts):
            p = g[m - 1 + k]
            top = p.topk(2)
            ok = d == int(top.indices[0]) or (acceptance == "relaxed" and d == int(top.indices[1])
                                               and float(top.values[1]) >= ratio * float(top.values[0]))
            if not ok:
                break
            n += 1
        out = {first + k: drafts[k] for k in range(n)}
        if n < len(drafts):
            if commit == "shifted":
                out[first + n] = int(g[m - 1 + n].argmax())
            elif n == 0:
                out[first] = drafts[0]
        return out
    return select


def reference_decode(model, prompt, length, block, select, attention, attn_block=None, guided=False, eos=EOS):
    x = list(prompt) + [MASK] * length
    p_len, forwards = len(prompt), 0

    for b in range(length // block):
        s = p_len + b * block
        step = 0
        while MASK in x[s : s + block]:
            logits = full_logits(model, x, p_len, attention, attn_block)
            forwards += 1
            rows = [logits[s + i - 1] for i in range(block)]
            masked = [x[s + i] == MASK for i in range(block)]
            commits = select(rows, masked, step, block, x, s) if guided else select(rows, masked, step, block)
            for i, t in commits.items():
                assert x[s + i] == MASK
                x[s + i] = t
            step += 1
            if decoded_up_to_eos(x, p_len, eos):
                break
        if decoded_up_to_eos(x, p_len, eos):
            break
    out = committed_answer(x, p_len, eos)
    return out, forwards


def decode(cfg: dict, model, prompt, guide=None, eos=EOS):
    decoder = build_decoder(cfg, mdm_tokenizer())
    if guide is not None:
        decoder.use_auxiliary({"guide": guide})
    with decoder.prepare(model):
        return decoder.decode(model, [prompt], {eos}, [0])[0], decoder


# -- baselines vs references ------------------------------------------------------------------------

L, B = 12, 4


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("steps", [4, 2, 3])
def test_lowconf_equals_reference(prompt, steps):
    model = mdm_model("bidirectional")
    result, _ = decode({"name": "mdm_lowconf", "max_new_tokens": L, "block_size": B, "steps_per_block": steps},
                       model, prompt)
    tokens, forwards = reference_decode(model, prompt, L, B, lowconf_rule(steps), "bidirectional")
    assert result.tokens == tokens and result.forwards == forwards
    assert result.stats["dlm_forwards"] == forwards and result.stats["guide_forwards"] == 0
    if len(tokens) == L and EOS not in tokens:
        assert forwards == (L // B) * steps  # fixed steps per block


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("tau", [0.5, 0.7, 0.9])
def test_threshold_without_cache_equals_reference(prompt, tau):
    model = mdm_model("bidirectional")
    cfg = {"name": "mdm_threshold", "max_new_tokens": L, "block_size": B, "threshold": tau, "prefix_cache": False}
    result, _ = decode(cfg, model, prompt)
    tokens, forwards = reference_decode(model, prompt, L, B, threshold_rule(tau), "bidirectional")
    assert result.tokens == tokens and result.forwards == forwards


def test_threshold_commits_several_tokens_per_step_at_a_low_threshold():
    model = mdm_model("bidirectional")
    result, _ = decode({"name": "mdm_threshold", "max_new_tokens": L, "block_size": B, "threshold": 0.7,
                        "prefix_cache": False}, model, PROMPTS[0])
    assert result.committed / result.forwards > 1


# Block-causal checkpoints: blocks left of the current one never see it, so the prefix cache and
# refreshed FreeCache are exact and the cached decoders must reproduce the full-recompute reference.
CACHED = [
    ({"name": "mdm_threshold", "threshold": 0.7}, threshold_rule(0.7)),
    ({"name": "mdm_threshold", "threshold": 0.7, "freecache": True}, threshold_rule(0.7)),
    ({"name": "mdm_lowconf", "freecache": True}, lowconf_rule(B)),
    ({"name": "mdm_lowconf", "freecache": True, "steps_per_block": 2}, lowconf_rule(2)),
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("case", range(len(CACHED)))
def test_cached_decoders_equal_reference_on_a_block_causal_model(prompt, case):
    cfg, rule = CACHED[case]
    model = mdm_model("block", block=B)
    result, _ = decode({**cfg, "max_new_tokens": L}, model, prompt)  # block size from the checkpoint
    assert result.stats["block_size"] == B
    tokens, forwards = reference_decode(model, prompt, L, B, rule, "block", B)
    assert result.tokens == tokens and result.forwards == forwards


def fed_lengths(cfg: dict, model, prompt) -> list[int]:
    """Positions fed by each forward of a decode (counted at the embedding)."""
    fed: list[int] = []
    handle = model.model.embed_tokens.register_forward_hook(lambda m, a, o: fed.append(a[0].shape[1]))
    try:
        decode(cfg, model, prompt)
    finally:
        handle.remove()
    return fed


def test_cached_steps_feed_fewer_positions():
    """The prefix cache and FreeCache are used: after each block's first (full) forward, fewer
    positions than that forward are fed."""
    model = mdm_model("block", block=B)
    for cfg in CACHED:
        fed = fed_lengths({**cfg[0], "max_new_tokens": L}, model, PROMPTS[2])
        assert fed[0] == len(PROMPTS[2]) + B and min(fed) < fed[0], (cfg[0], fed)


@pytest.mark.parametrize("decode_block,attn_block", [(4, 4), (2, 4), (6, 4), (4, 2)])
def test_block_attention_windows_end_at_the_attention_block(decode_block, attn_block):
    """With block attention no forward feeds positions right of the attention block that holds the
    current decoding block's last position (they cannot reach it), and the tokens still equal the
    full-sequence reference, for decoding blocks that do and do not line up with attention blocks."""
    model = mdm_model("block", block=attn_block)
    prompt, steps = PROMPTS[1], 2
    cfg = {"name": "mdm_lowconf", "max_new_tokens": L, "block_size": decode_block, "steps_per_block": steps}
    fed = fed_lengths(cfg, model, prompt)
    p_len = len(prompt)
    ends = [p_len - (-((b + 1) * decode_block) // attn_block) * attn_block for b in range(L // decode_block)]
    assert fed == [min(end, p_len + L) for end in ends for _ in range(steps)]  # no cache: each window from 0
    result, _ = decode(cfg, model, prompt)
    tokens, forwards = reference_decode(model, prompt, L, decode_block, lowconf_rule(steps), "block", attn_block)
    assert result.tokens == tokens and result.forwards == forwards


@pytest.mark.parametrize("case", range(len(CACHED)))
def test_early_stop_at_eos_equals_reference(case):
    """Decoding stops once everything up to the first EOS is committed; the output ends there."""
    cfg, rule = CACHED[case]
    model = mdm_model("block", block=B)
    full, _ = decode({**cfg, "max_new_tokens": L}, model, PROMPTS[0], eos=-1)
    eos = full.tokens[5]  # a token the run emits: call it EOS
    result, _ = decode({**cfg, "max_new_tokens": L}, model, PROMPTS[0], eos=eos)
    tokens, forwards = reference_decode(model, PROMPTS[0], L, B, rule, "block", B, eos=eos)
    assert result.tokens == tokens and result.forwards == forwards
    assert result.tokens[-1] == eos and eos not in result.tokens[:-1] and result.hit_eos
    assert result.forwards <= full.forwards


# -- FreeCache frozen K/V -----------------------------------------------------------------------------


def full_kv(model, tokens: torch.Tensor, prompt_len: int, attention: str, attn_block: int | None):
    n = tokens.numel()
    blocks = [0 if p < prompt_len else 1 + (p - prompt_len) // (attn_block or 1) for p in range(n)]
    mask = torch.zeros(1, 1, n, n)
    for i in range(n):
        for j in range(n):
            if attention == "block" and blocks[j] > blocks[i]:
                mask[0, 0, i, j] = torch.finfo(torch.float32).min
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=tokens[None], position_ids=torch.arange(n)[None], attention_mask=mask,
              **cache_argument(cache), use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("mode", ["refresh", "freeze_last"])
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_freecache_frozen_kv_equal_a_full_forward(mode, prompt):
    """Block-causal model (frozen blocks never see later ones, so the comparison is exact in every
    layer). refresh: every frozen block's K/V equal a full forward over the tokens after the block
    completed. freeze_last: block 0's K/V equal a full forward over the tokens *at its last step*,
    when the positions it unmasked last were still <|mask|>."""
    model = mdm_model("block", block=B)
    decoder = build_decoder({"name": "mdm_lowconf", "max_new_tokens": L, "freecache": True, "freecache_mode": mode,
                             "steps_per_block": 2}, mdm_tokenizer())
    decoder.kv_snapshots = []
    with decoder.prepare(model):
        decoder.decode(model, [prompt], set(), [0])  # no EOS: every block completes
    snaps = decoder.kv_snapshots
    p_len = len(prompt)
    if mode == "refresh":
        assert [s["block"] for s in snaps] == [-1, 0, 1]  # the prompt, then each finished block but the last
        for snap in snaps:
            frozen = snap["frozen_len"]
            assert MASK not in snap["tokens"][:frozen + 1].tolist()  # refreshed with the final tokens
            for (k, v), (rk, rv) in zip(snap["kv"], full_kv(model, snap["tokens"], p_len, "block", B)):
                torch.testing.assert_close(k, rk[:, :, :frozen], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, rv[:, :, :frozen], atol=1e-5, rtol=1e-5)
    else:
        assert [s["block"] for s in snaps] == [0, 1, 2]
        first = snaps[0]
        s0, e0 = p_len, p_len + B
        assert first["frozen_len"] == e0 - 1
        assert MASK in first["tokens"][s0:e0].tolist()  # unmasked at the last step: cached as <|mask|>
        for (k, v), (rk, rv) in zip(first["kv"], full_kv(model, first["tokens"], p_len, "block", B)):
            torch.testing.assert_close(k, rk[:, :, : e0 - 1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, rv[:, :, : e0 - 1], atol=1e-5, rtol=1e-5)


def test_freecache_shrinks_the_window():
    """FreeCache feeds fewer positions per step than a full recompute (counted through a hook)."""
    model = mdm_model("bidirectional")
    fed = []
    handle = model.model.embed_tokens.register_forward_hook(lambda m, a, o: fed.append(a[0].shape[1]))
    try:
        decode({"name": "mdm_lowconf", "max_new_tokens": L, "block_size": B, "freecache": True}, model, PROMPTS[2])
    finally:
        handle.remove()
    n = len(PROMPTS[2]) + L
    assert fed[0] == n and max(fed[1:]) < n and fed[-1] <= B + 1


# -- guided ------------------------------------------------------------------------------------------


@pytest.fixture()
def guide_dir(tmp_path) -> Path:
    path = tmp_path / "guide"
    tiny_model(VOCAB - 1, "qwen3", seed=3).save_pretrained(path)
    tiny_tokenizer(FILLERS).save_pretrained(path)
    return path


def load_guide(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("freecache", [False, True])
def test_guided_shifted_strict_equals_the_guides_ar_greedy(guide_dir, prompt, freecache):
    guide = load_guide(guide_dir)
    model = mdm_model("bidirectional")
    cfg = {"name": "mdm_guided", "guide": str(guide_dir), "max_new_tokens": L, "block_size": B, "commit": "shifted",
           "acceptance": "strict", "freecache": freecache}
    result, _ = decode(cfg, model, prompt, guide)
    ar = ARDecoder(ARDecoderConfig(max_new_tokens=L), tiny_tokenizer(FILLERS)).decode(guide, [prompt], {EOS}, [0])[0]
    assert result.tokens == ar.tokens
    assert result.forwards == result.stats["dlm_forwards"] + result.stats["guide_forwards"]
    assert result.stats["dlm_forwards"] == result.stats["guide_forwards"]


@pytest.mark.parametrize("commit", ["assisted", "shifted"])
@pytest.mark.parametrize("acceptance", ["strict", "relaxed"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_guided_equals_reference(guide_dir, commit, acceptance, prompt):
    guide = load_guide(guide_dir)
    model = mdm_model("bidirectional")
    cfg = {"name": "mdm_guided", "guide": str(guide_dir), "max_new_tokens": L, "block_size": B, "commit": commit,
           "acceptance": acceptance}
    result, _ = decode(cfg, model, prompt, guide)
    tokens, forwards = reference_decode(model, prompt, L, B, guided_rule(guide, commit, acceptance), "bidirectional",
                                        guided=True)
    assert result.tokens == tokens and result.stats["dlm_forwards"] == forwards


def test_guided_with_freecache_equals_reference_on_a_block_causal_model(guide_dir):
    guide = load_guide(guide_dir)
    model = mdm_model("block", block=B)
    for prompt in PROMPTS:
        cfg = {"name": "mdm_guided", "guide": str(guide_dir), "max_new_tokens": L, "freecache": True}
        result, _ = decode(cfg, model, prompt, guide)
        tokens, _ = reference_decode(model, prompt, L, B, guided_rule(guide, "assisted", "strict"), "block", B,
                                     guided=True)
        assert result.tokens == tokens


def test_guided_decoding_through_evaluate_reports_both_forward_counts(guide_dir):
    guide = load_guide(guide_dir)
    model = mdm_model("bidirectional")
    rows = datasets.Dataset.from_list(EVAL_ROWS[:3])
    cfg = {"name": "mdm_guided", "guide": str(guide_dir), "max_new_tokens": 8, "block_size": 4}
    result = evaluate(model, mdm_tokenizer(), rows, cfg, agreement=False, auxiliary={"guide": guide})
    m = result.metrics
    dlm = sum(r["stats"]["dlm_forwards"] for r in result.records)
    guide_f = sum(r["stats"]["guide_forwards"] for r in result.records)
    committed = sum(r["committed"] for r in result.records)
    assert (math.isclose(m["dlm_forwards_per_sample"], dlm / 3)
            and math.isclose(m["guide_forwards_per_sample"], guide_f / 3))
    assert math.isclose(m["tpf_dlm"], committed / dlm) and math.isclose(m["tpf_all"], committed / (dlm + guide_f))
    assert 0 <= m["guide_acceptance"] <= 1


def test_evaluate_runs_no_ar_reference_on_an_mdm_export():
    """agreement=True compares a decoder with the model's own AR greedy; an MDM export has none (its
    attention is bidirectional or block-causal): no reference is decoded and the agreement is n/a."""
    rows = datasets.Dataset.from_list(EVAL_ROWS[:2])
    cfg = {"name": "mdm_lowconf", "max_new_tokens": 8, "block_size": 4, "steps_per_block": 2}
    result = evaluate(mdm_model("bidirectional"), mdm_tokenizer(), rows, cfg, agreement=True)
    assert [r["reference_ids"] for r in result.records] == [None, None]
    assert result.metrics["agreement_exact"] is None and result.metrics["agreement_prefix"] is None


# -- named errors ---------------------------------------------------------------------------------------


def test_guide_with_another_tokenizer_is_a_named_error(tmp_path):
    path = tmp_path / "other"
    tiny_model(VOCAB - 1, "qwen3", seed=3).save_pretrained(path)
    tiny_tokenizer(tuple(f"z{i}" for i in range(len(FILLERS)))).save_pretrained(path)
    decoder = build_decoder({"name": "mdm_guided", "guide": str(path), "max_new_tokens": L, "block_size": B},
                            mdm_tokenizer())
    decoder.use_auxiliary({"guide": load_guide(path)})
    with (pytest.raises(ConfigError, match="decoder.guide=.*tokenizer differs"),
          decoder.prepare(mdm_model("bidirectional"))):
        pass


@pytest.mark.parametrize("name", ["mdm_lowconf", "mdm_threshold", "wino", "saber", "cover"])
def test_non_mdm_checkpoint_is_a_named_error(name):
    """Every decoder of a bidirectional MDM refuses an I-DLM export, in decode and in prepare, and
    leaves the model's attention as it was (COVER installs its own)."""
    model = tiny_model(VOCAB, "qwen3")
    model.config.pardec = {"recipe": "idlm", "mask_token_id": MASK, "isd_stride": 3}
    decoder = build_decoder({"name": name, "max_new_tokens": L, "block_size": B}, mdm_tokenizer())
    with pytest.raises(CheckpointError, match="not an MDM export.*recipe='idlm'"):
        decoder.decode(model, [PROMPTS[0]], {EOS}, [0])
    with pytest.raises(CheckpointError, match="not an MDM export"), decoder.prepare(model):
        pass
    assert model.config._attn_implementation == "sdpa"


def test_length_not_a_multiple_of_the_block_size_is_a_named_error():
    decoder = build_decoder({"name": "mdm_lowconf", "max_new_tokens": 10, "block_size": 4}, mdm_tokenizer())
    with pytest.raises(ConfigError, match="decoder.max_new_tokens' = 10 is not a multiple of the block size 4"):
        decoder.decode(mdm_model("bidirectional"), [PROMPTS[0]], {EOS}, [0])


@pytest.mark.parametrize("key,value", [("freecache_mode", "sometimes"), ("block_size", 0)])
def test_bad_options_are_named_errors(key, value):
    with pytest.raises(ConfigError, match=f"decoder.{key}"):
        build_decoder({"name": "mdm_lowconf", key: value}, mdm_tokenizer())


def test_prepare_switches_attention_to_non_causal_and_restores_it():
    model = mdm_model("bidirectional")
    flags = [m.is_causal for m in model.modules() if hasattr(m, "is_causal")]
    assert flags and all(flags)
    decoder = build_decoder({"name": "mdm_lowconf", "max_new_tokens": L, "block_size": B}, mdm_tokenizer())
    with decoder.prepare(model):
        assert not any(m.is_causal for m in model.modules() if hasattr(m, "is_causal"))
    assert all(m.is_causal for m in model.modules() if hasattr(m, "is_causal"))
