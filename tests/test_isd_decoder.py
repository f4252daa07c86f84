"""ISD decoder (I-DLM, arXiv:2604.11035): lossless greedy, KV cache vs recomputation, the training
mask, exact acceptance bookkeeping, sampling distribution, TPF formula, alpha, validation hook."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import DynamicCache, Qwen3Config

from pardec.common.errors import ConfigError
from pardec.common.kv_cache import CACHE_KEYWORD, cache_argument
from pardec.data_pipelines.idlm_batch import build_idlm_batch
from pardec.inference.config import validate_validate_config
from pardec.inference.decoders.isd import (
    ISDDecoder,
    StepMasks,
    introspective_acceptance,
    introspective_ratios,
    step_attention_mask,
    step_forward,
)
from pardec.inference.decoders.registry import build_decoder
from pardec.inference.decoders.sampling import SamplingParams, probs_from_logits
from pardec.inference.evaluate import evaluate
from pardec.inference.isd_metrics import isd_summary, isd_tpf
from pardec.masks.core import materialize
from tests.conftest import EVAL_ROWS, tiny_model, tiny_tokenizer

torch.set_num_threads(1)

VOCAB = 40
MASK = 39
PROMPTS = [[3, 4, 5, 6, 7], [8], [9, 10, 11], [1, 19, 19]]
NO_EOS: set[int] = set()


def with_mask(model, mask_id: int = MASK, stride: int | None = None):
    model.config.pardec = {"mask_token_id": mask_id, **({"isd_stride": stride} if stride else {})}
    return model


def random_lm(arch: str):
    """Random tiny LM: its mask drafts are almost always wrong (rejection paths)."""
    return with_mask(tiny_model(VOCAB, arch, seed=0))


def parrot_lm(arch: str):
    """Random tiny LM (seed 1, whose greedy outputs fall into runs of token 19) whose <|mask|> input
    embedding is token 19's: inside a run of 19s a mask sees what AR sees, so its drafts are right
    (accept + bonus paths); before the run they are wrong. The LM head is untied first."""
    model = tiny_model(VOCAB, arch, seed=1)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        model.get_input_embeddings().weight[MASK] = model.get_input_embeddings().weight[19]
    return with_mask(model)


MODELS = {"random": random_lm, "parrot": parrot_lm}


def isd(**overrides):
    return build_decoder({"name": "isd", "max_new_tokens": 16, **overrides}, tokenizer=None)


def ar_greedy(model, prompt, max_new_tokens=16, eos=NO_EOS) -> list[int]:
    decoder = build_decoder({"name": "ar", "max_new_tokens": max_new_tokens}, None)
    return decoder.decode(model, [prompt], eos, [0])[0].tokens


# ----------------------------------------------------------------------------------------------
# Greedy: lossless w.r.t. AR greedy, KV cache == recomputation, training mask
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["random", "parrot"])
def test_greedy_is_token_identical_to_ar_greedy(arch, kind):
    model = MODELS[kind](arch)
    totals = Counter()
    for stride in (2, 3, 4):
        for prompt in PROMPTS:
            result = isd(stride=stride).decode_one(model, prompt, NO_EOS, 0)
            assert result.tokens == ar_greedy(model, prompt), (stride, prompt)
            assert result.committed == len(result.tokens) == 16 and not result.hit_eos
            assert 1 <= result.forwards <= result.committed
            s = result.stats
            assert result.forwards == s["propose_steps"] + s["verify_steps"]
            # committed (before the cap) = propose steps + verify steps + accepted drafts
            assert result.committed <= s["propose_steps"] + s["verify_steps"] + sum(s["accepted"])
            totals["accepted"] += sum(s["accepted"])
            totals["all_accepted"] += s["accepted"][-1]
            totals["rejected"] += s["verify_steps"] - s["accepted"][-1]
    assert totals["rejected"] > 0
    if kind == "parrot":  # the bonus / kept-drafts path is exercised too
        assert totals["all_accepted"] > 0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_eos_inside_a_step_stops_there(arch):
    for kind, build in MODELS.items():
        model = build(arch)
        for stride in (2, 3, 4):
            for prompt in PROMPTS:
                free = ar_greedy(model, prompt)
                eos = free[4]  # AR greedy's 5th token becomes EOS
                expected = free[: free.index(eos) + 1]
                result = isd(stride=stride).decode_one(model, prompt, {eos}, 0)
                assert result.tokens == expected and result.hit_eos, (kind, stride, prompt)
                assert result.tokens == ar_greedy(model, prompt, eos={eos})


def test_greedy_eos_on_an_accepted_first_draft():
    """EOS as the first draft of a verify step whose later drafts are accepted too: prompt
    9 10 11 -> 8 19 19 19 ...; the bootstrap commits 8 (drafts 19 19 19), the next step accepts
    all three drafts but commits only up to the first 19."""
    model = parrot_lm("qwen3")
    assert ar_greedy(model, [9, 10, 11], 5) == [8, 19, 19, 19, 19]
    result = isd(stride=4).decode_one(model, [9, 10, 11], {19}, 0)
    assert result.tokens == [8, 19] and result.hit_eos and result.forwards == 2
    assert result.stats["accepted"] == [1, 1, 1]


def reference_isd_greedy(model, prompt, stride, max_new_tokens, eos):
    """No cache: every step re-runs prompt + output + drafts + masks with a dense lower-triangular
    float mask (the masks are last, so strict causal is exactly the I-DLM predicate here)."""
    seq, drafts, forwards = list(prompt), [], 0
    n_out = 0
    while True:
        ids = seq + drafts + [MASK] * (stride - 1)
        n = len(ids)
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]  # [1, 1, n, n]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), attention_mask=mask,
                           position_ids=torch.arange(n)[None]).logits[0]
        forwards += 1
        targets = logits[len(seq) - 1 : len(seq) + len(drafts)].argmax(-1).tolist()  # anchors
        new = []
        for k, draft in enumerate(drafts):
            if draft != targets[k]:
                new.append(targets[k])
                break
            new.append(draft)
        else:
            new.append(targets[len(drafts)])
        all_ok = len(new) == len(drafts) + 1 and new[:-1] == drafts
        drafts = logits[len(seq) + len(drafts) :].argmax(-1).tolist() if all_ok else []
        for tok in new:
            seq.append(tok)
            n_out += 1
            if tok in eos or n_out == max_new_tokens:
                return seq[len(prompt) :], forwards


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["random", "parrot"])
def test_kv_cached_isd_equals_recomputation_without_cache(arch, kind):
    model = MODELS[kind](arch)
    for stride in (2, 3, 4):
        for prompt in PROMPTS:
            free = ar_greedy(model, prompt, 12)
            for eos in (NO_EOS, {free[6]}):
                result = isd(stride=stride, max_new_tokens=12).decode_one(model, prompt, eos, 0)
                tokens, forwards = reference_isd_greedy(model, prompt, stride, 12, eos)
                assert (result.tokens, result.forwards) == (tokens, forwards), (stride, prompt, eos)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_step_forward_with_cache_and_4d_mask_equals_training_layout(arch, attn):
    """Every query of a verify step sees what it sees in I-DLM training: the clean queries equal
    the x_0 stream, the masks equal the x_t block right after the clean context (same logits)."""
    model = random_lm(arch)
    model.config._attn_implementation = attn
    stride = 3
    block = stride - 1
    clean = [5, 9, 2, 11, 7, 3, 8, 14, 6, 21]  # committed (cached) + pending + drafts
    c = 7  # pending at position c; drafts at c+1, c+2; masks at c+3, c+4 == block 5 (positions 10, 11)
    assert (c + stride) % block == 0
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([clean[:c]]), position_ids=torch.arange(c)[None], **cache_argument(cache),
              use_cache=True)
        step = step_forward(model, cache, clean[c:], MASK, stride - 1)  # [2N-1, V]
    assert cache.get_seq_length() == c + 2 * stride - 1

    sample = {"input_ids": clean + [1, 2], "prompt_len": 3}  # x_t masks every position >= 3
    batch = build_idlm_batch([sample], mask_token_id=MASK, block_size=block, pack_length=2 * len(sample["input_ids"]))
    with torch.no_grad():
        train = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                      attention_mask=materialize(batch["attention"], attn, torch.float32)).logits[0]
    length = len(sample["input_ids"])
    x0 = train[length + c : length + c + stride]  # clean queries at positions c .. c+N-1
    xt = train[c + stride : c + 2 * stride - 1]  # x_t masks at positions c+N .. c+2N-2
    torch.testing.assert_close(step[:stride], x0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[stride:], xt, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stride", [2, 4])
def test_step_masks_equal_the_predicate_at_every_cache_length(stride):
    """StepMasks evaluates the predicate once per step shape; every mask it hands out equals the
    mask evaluated for that very cache length."""
    masks = StepMasks(torch.float32, "cpu")
    for cache_len in range(0, 70):
        for n_clean in (1, stride):  # propose and verify steps
            mask = masks.get(cache_len, n_clean, stride - 1)
            expected = step_attention_mask(cache_len, n_clean, stride - 1, torch.float32, "cpu")
            assert mask.shape == expected.shape, (cache_len, n_clean)
            assert torch.equal(mask, expected), (cache_len, n_clean)
            assert mask.is_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_on_cuda_is_token_identical_to_ar_greedy():
    """The step masks reach SDPA's CUDA kernels at every cache length (a misaligned mask crashed the
    memory-efficient kernel once), and ISD still reproduces AR greedy there (fp32: no bf16 ties)."""
    model = parrot_lm("qwen3").to("cuda")
    for stride in (2, 4):
        for prompt in PROMPTS:
            result = isd(stride=stride, max_new_tokens=40).decode_one(model, prompt, NO_EOS, 0)
            assert result.tokens == ar_greedy(model, prompt, 40), (stride, prompt)


# ----------------------------------------------------------------------------------------------
# Exact bookkeeping with a fake "counting" LM whose draft quality is set by construction
# ----------------------------------------------------------------------------------------------


class CountingLM(torch.nn.Module):
    """A fake causal LM over tokens 0..C-1 (``<|mask|>`` = C): the token after t is (t+1) mod C.

    A mask query at position j drafts the token at j+1 from the last clean token it can see
    (read from the 4-D additive mask): token t at position c -> (t + j + 1 - c) mod C, i.e. the
    right draft, except that drafts of index k = j - c > ``n_correct`` are off by one (wrong).
    Its "K/V cache" stores (token, position) pairs in layer 0 of the ``DynamicCache``, so
    ``crop`` works as for a real model; every call records the cache contents and the inputs.
    """

    def __init__(self, n_correct: int, stride: int, count: int = 50):
        super().__init__()
        self.count, self.mask_id, self.n_correct = count, count, n_correct
        self.config = Qwen3Config(vocab_size=count + 1, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=8)
        self.config._attn_implementation = "sdpa"
        self.config.pardec = {"mask_token_id": count, "isd_stride": stride}
        self.dtype = torch.float32
        self.device_anchor = torch.nn.Parameter(torch.zeros(()))
        self.calls: list[dict] = []

    def forward(self, input_ids, position_ids, attention_mask=None, **kwargs):
        cache = kwargs[CACHE_KEYWORD]
        cached = cache.get_seq_length()
        pairs = torch.stack([input_ids, position_ids], -1).float()[:, None]  # [1, 1, q, 2]
        keys, _ = cache.update(pairs, pairs, 0)
        tokens, positions = keys[0, 0, :, 0].long(), keys[0, 0, :, 1].long()  # [kv]
        self.calls.append({"cached": tokens[:cached].tolist(), "inputs": input_ids[0].tolist(),
                           "positions": position_ids[0].tolist()})
        logits = torch.zeros(input_ids.shape[1], self.count + 1)
        for i, (tok, pos) in enumerate(zip(input_ids[0].tolist(), position_ids[0].tolist())):
            if tok != self.mask_id:
                target = tok + 1
            else:
                visible = (attention_mask[0, 0, i] == 0) & (tokens != self.mask_id)  # [kv]
                last = int(torch.where(visible, positions, -1).argmax())
                k = pos - int(positions[last])  # this mask drafts the k-th token after the last clean one's successor
                target = int(tokens[last]) + k + 1 + (k > self.n_correct)
            logits[i, target % self.count] = 1.0
        return SimpleNamespace(logits=logits[None])


def check_cache_invariant(model: CountingLM, prompt: list[int], tokens: list[int], stride: int) -> None:
    """Before every forward the cache holds exactly the committed sequence minus its last token,
    which is the first input; then come 0 or N-1 drafts and N-1 masks at consecutive positions."""
    full = prompt + tokens
    for call in model.calls[1:]:  # calls[0] is the prefill
        n = len(call["cached"])
        assert call["cached"] == full[:n] and call["inputs"][0] == full[n]
        assert call["positions"] == list(range(n, n + len(call["inputs"])))
        assert len(call["inputs"]) in (stride, 2 * stride - 1)
        assert call["inputs"][-(stride - 1) :] == [model.mask_id] * (stride - 1)
        assert model.mask_id not in call["cached"]


@pytest.mark.parametrize("stride", [2, 3, 4, 5])
def test_all_correct_drafts_reach_stride_tokens_per_verify_step(stride):
    cycles = 6
    max_new = 1 + stride * cycles  # bootstrap (1 token) + 6 verify steps (N tokens each)
    model = CountingLM(n_correct=stride - 1, stride=stride)
    result = isd(max_new_tokens=max_new).decode_one(model, [0], NO_EOS, 0)  # stride from pardec
    assert result.tokens == list(range(1, max_new + 1))
    assert result.forwards == 1 + cycles
    assert result.stats == {"stride": stride, "propose_steps": 1, "verify_steps": cycles,
                            "reached": [cycles] * (stride - 1), "accepted": [cycles] * (stride - 1)}
    check_cache_invariant(model, [0], result.tokens, stride)
    summary = isd_summary([{"committed": result.committed, "forwards": result.forwards, "stats": result.stats}])
    assert summary["isd_tpf_predicted"] == stride
    assert summary["isd_tpf_measured"] == max_new / (1 + cycles)  # -> N as the generation grows
    assert all(summary[f"isd_P_{k}"] == 1.0 for k in range(1, stride))


@pytest.mark.parametrize("stride", [2, 3, 4, 5])
def test_all_wrong_drafts_give_one_token_per_forward(stride):
    model = CountingLM(n_correct=0, stride=stride)
    result = isd(stride=stride, max_new_tokens=12).decode_one(model, [7], NO_EOS, 0)
    assert result.tokens == list(range(8, 20))
    assert result.forwards == result.committed == 12
    assert result.stats["propose_steps"] == result.stats["verify_steps"] == 6
    assert result.stats["reached"] == [6] + [0] * (stride - 2) and result.stats["accepted"] == [0] * (stride - 1)
    check_cache_invariant(model, [7], result.tokens, stride)
    summary = isd_summary([{"committed": 12, "forwards": 12, "stats": result.stats}])
    assert summary["isd_tpf_predicted"] == summary["isd_tpf_measured"] == 1.0


@pytest.mark.parametrize("stride,n_correct", [(3, 1), (4, 1), (4, 2), (5, 3)])
def test_partly_correct_drafts_match_the_tpf_formula_exactly(stride, n_correct):
    """Drafts 1..m right, m+1 wrong: propose (1 token) + verify (m accepted + 1 corrected) per cycle,
    so TPF = (m + 2) / 2 = (2 + P_1 + ... + P_{N-2}) / (2 - P_{N-1}) with P_k = [k <= m]."""
    cycles = 5
    max_new = cycles * (n_correct + 2)
    model = CountingLM(n_correct=n_correct, stride=stride)
    result = isd(stride=stride, max_new_tokens=max_new).decode_one(model, [1, 2, 3], NO_EOS, 0)
    assert result.tokens == list(range(4, 4 + max_new))
    assert result.forwards == 2 * cycles
    assert result.stats["reached"] == [cycles] * (n_correct + 1) + [0] * (stride - 2 - n_correct)
    assert result.stats["accepted"] == [cycles] * n_correct + [0] * (stride - 1 - n_correct)
    check_cache_invariant(model, [1, 2, 3], result.tokens, stride)
    summary = isd_summary([{"committed": result.committed, "forwards": result.forwards, "stats": result.stats}])
    assert summary["isd_tpf_measured"] == summary["isd_tpf_predicted"] == (n_correct + 2) / 2
    assert summary[f"isd_accept_rate_{n_correct + 1}"] == 0.0


def test_eos_and_max_new_tokens_truncate_an_accepted_run():
    model = CountingLM(n_correct=3, stride=4)
    # bootstrap commits 1 (drafts 2 3 4); the verify step accepts 2 3 4 + bonus 5: EOS 3 stops there.
    result = isd(max_new_tokens=50).decode_one(model, [0], {3}, 0)
    assert result.tokens == [1, 2, 3] and result.hit_eos and result.forwards == 2
    assert result.stats["accepted"] == [1, 1, 1]  # acceptance counts the verification, not the cut
    capped = isd(max_new_tokens=3).decode_one(CountingLM(n_correct=3, stride=4), [0], NO_EOS, 0)
    assert capped.tokens == [1, 2, 3] and not capped.hit_eos and capped.forwards == 2
    first = isd(max_new_tokens=50).decode_one(CountingLM(n_correct=3, stride=4), [0], {1}, 0)
    assert first.tokens == [1] and first.forwards == 1  # EOS from the bootstrap anchor


# ----------------------------------------------------------------------------------------------
# Sampling: distributed exactly as AR sampling
# ----------------------------------------------------------------------------------------------

SMALL_VOCAB, SMALL_MASK = 8, 7
SAMPLE_PROMPT = [1, 2, 3]
NUCLEUS = {"temperature": 0.8, "top_k": 4, "top_p": 0.95}  # every transform; support mismatches dominate
COLD = {"temperature": 0.15, "top_k": 0, "top_p": 1.0}  # full support: p/q < 1 drives the rejections


def small_lm():
    """Vocabulary 8 (mask 7); the mask embedding is a fixed random vector of 3x the embedding
    scale, so the drafts' q differs from p (both acceptance and rejection happen)."""
    model = with_mask(tiny_model(SMALL_VOCAB, "qwen3", seed=5), SMALL_MASK)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        embed[SMALL_MASK] = 3.0 * embed.std() * torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(0))
    return model


def exact_ar_distribution(model, prompt, length, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """Joint distribution of the first ``length`` AR-sampled tokens, by enumeration (no cache)."""
    dist = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, mass in dist.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1:]
            probs = probs_from_logits(logits, params)[0]
            for tok in torch.nonzero(probs).flatten().tolist():
                nxt[prefix + (tok,)] = mass * float(probs[tok])
        dist = nxt
    return dist


def chi_square_p_value(counts: Counter, expected: dict, n: int) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    assert set(counts) <= set(expected), f"sampled outside the AR support: {set(counts) - set(expected)}"
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, prob in expected.items():
        if n * prob < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[key], pooled_exp + n * prob
            continue
        stat += (counts[key] - n * prob) ** 2 / (n * prob)
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def isd_vs_ar(n: int, length: int, sampling: dict, **cfg) -> tuple[float, float, int, dict]:
    """ISD-sample ``n`` generations of ``length`` tokens (seeds 0..n-1) from :func:`small_lm`:
    ``(chi-square p-value, total variation, cells, isd_summary)`` against the exact AR joint."""
    model = small_lm()
    expected = exact_ar_distribution(model, SAMPLE_PROMPT, length, SamplingParams(False, **sampling))
    decoder = isd(mode="sample", max_new_tokens=length, **sampling, **cfg)
    results = [decoder.decode_one(model, SAMPLE_PROMPT, NO_EOS, seed) for seed in range(n)]
    counts = Counter(tuple(r.tokens) for r in results)
    tv = 0.5 * sum(abs(counts[k] / n - p) for k, p in expected.items())
    stats = isd_summary([{"committed": r.committed, "forwards": r.forwards, "stats": r.stats} for r in results])
    return chi_square_p_value(counts, expected, n), tv, len(expected), stats


def check_matches_ar(n: int, length: int, stride: int, sampling: dict) -> None:
    p_value, tv, cells, stats = isd_vs_ar(n, length, sampling, stride=stride)
    # Both acceptance and rejection happen (else the test would not exercise the p/q rule).
    assert 0.1 < stats["isd_P_1"] < 0.9, stats
    # Fixed seeds, so deterministic; under H0 each assertion fails with probability <= 1e-3:
    # chi-square, and TV against E[TV] <= 0.5 sqrt(K/n) (Cauchy-Schwarz) + sqrt(ln(1e3) / 2n) (McDiarmid).
    assert p_value > 1e-3, (p_value, tv)
    assert tv < 0.5 * math.sqrt(cells / n) + math.sqrt(math.log(1e3) / (2 * n)), tv


@pytest.mark.parametrize("sampling,stride", [(NUCLEUS, 2), (COLD, 3)], ids=["nucleus-N2", "cold-N3"])
def test_sampling_matches_ar_distribution_fast(sampling, stride):
    check_matches_ar(n=800, length=2, stride=stride, sampling=sampling)


@pytest.mark.slow
@pytest.mark.parametrize("sampling,stride", [(NUCLEUS, 2), (NUCLEUS, 3), (COLD, 3)],
                         ids=["nucleus-N2", "nucleus-N3", "cold-N3"])
def test_sampling_matches_ar_distribution_three_tokens(sampling, stride):
    check_matches_ar(n=4000, length=3, stride=stride, sampling=sampling)


def test_sampling_test_has_power_against_always_accepting():
    """tau huge = every draft in p's support accepted = token 2 follows q, not p: the same test
    (same n) rejects it."""
    with pytest.warns(UserWarning, match="no longer follow"):
        p_value, _, _, stats = isd_vs_ar(800, 2, COLD, stride=2, tau=1e9)
    assert stats["isd_P_1"] == 1.0 and p_value < 1e-6


def test_argmax_drafts_are_flagged_as_inexact():
    """The official server's "fast" argmax drafts with p/q verification: flagged, and measurably
    not the AR sampling distribution (not asserted equal)."""
    with pytest.warns(UserWarning, match="draft_mode='argmax'"):
        fast = isd(mode="sample", draft_mode="argmax", stride=2)
    assert not fast.distribution_exact
    assert fast.summarize([{"committed": 1, "forwards": 1, "stats": {"stride": 2, "propose_steps": 1,
                           "verify_steps": 0, "reached": [0], "accepted": [0]}}])["isd_distribution_exact"] is False
    assert isd(mode="sample").distribution_exact and isd().distribution_exact
    with pytest.warns(UserWarning):
        p_value, _, _, _ = isd_vs_ar(800, 2, NUCLEUS, stride=2, draft_mode="argmax")
    assert p_value < 1e-6


def test_sampling_is_reproducible_per_seed():
    model = small_lm()
    decoder = isd(mode="sample", stride=3, max_new_tokens=10, **NUCLEUS)
    runs = [decoder.decode_one(model, SAMPLE_PROMPT, NO_EOS, seed).tokens for seed in (5, 5, 6)]
    assert runs[0] == runs[1] and len(runs[0]) == 10


# ----------------------------------------------------------------------------------------------
# TPF formula, alpha, config errors, evaluate hook
# ----------------------------------------------------------------------------------------------


def test_tpf_formula_on_hand_made_acceptance():
    assert isd_tpf([1.0, 1.0, 1.0]) == 4.0  # N = 4, everything accepted
    assert isd_tpf([0.0, 0.0, 0.0]) == 1.0  # AR
    assert isd_tpf([0.5]) == 2 / 1.5  # N = 2: 2 / (2 - P_1)
    p = 0.8  # paper Eq. 5 with P_k = p^k, N = 4
    assert isd_tpf([p, p**2, p**3]) == pytest.approx((2 + p + p**2) / (2 - p**3))
    assert isd_tpf([0.9, 0.6, 0.3]) == pytest.approx(3.5 / 1.7)
    with pytest.raises(ValueError):
        isd_tpf([])
    with pytest.raises(ValueError):
        isd_tpf([1.2])


def test_isd_summary_sums_samples():
    records = [
        {"committed": 9, "forwards": 4, "stats": {"stride": 3, "propose_steps": 2, "verify_steps": 2,
                                                  "reached": [2, 1], "accepted": [1, 1]}},
        {"committed": 5, "forwards": 3, "stats": {"stride": 3, "propose_steps": 1, "verify_steps": 2,
                                                  "reached": [2, 2], "accepted": [2, 0]}},
    ]
    s = isd_summary(records)
    assert s["isd_verify_steps"] == 4 and s["isd_propose_steps"] == 3
    assert s["isd_P_1"] == 0.75 and s["isd_P_2"] == 0.25
    assert s["isd_accept_rate_1"] == 0.75 and s["isd_accept_rate_2"] == 1 / 3
    assert s["isd_tpf_predicted"] == pytest.approx(2.75 / 1.75) and s["isd_tpf_measured"] == 2.0
    with pytest.raises(ValueError, match="one stride"):
        isd_summary(records + [{"committed": 1, "forwards": 1, "stats": {**records[0]["stats"], "stride": 2}}])


def reference_ratios(model, prompt, generated, stride):
    """Separate plain causal forwards: q from [clean <= c_s, masks], p from the full sequence."""
    full = prompt + generated
    with torch.no_grad():
        p_all = torch.softmax(model(torch.tensor([full])).logits[0], -1)
    ratios = []
    for g in range(len(generated)):
        if g % stride == 0:
            continue
        c = len(prompt) - 1 + (g // stride) * stride  # last clean position before g's stride
        j = g % stride
        with torch.no_grad():
            q = torch.softmax(model(torch.tensor([full[: c + 1] + [MASK] * j])).logits[0, -1], -1)
        tok = full[len(prompt) + g]
        ratios.append(min(1.0, float(p_all[len(prompt) + g - 1, tok] / q[tok])))
    return torch.tensor(ratios)


@pytest.mark.parametrize("stride", [2, 3, 4])
def test_introspective_ratios_match_separate_forwards(stride):
    model = parrot_lm("qwen3")
    prompt = [3, 4, 5, 6, 7]
    generated = ar_greedy(model, prompt, 11)
    ratios = introspective_ratios(model, prompt, generated, MASK, stride)
    torch.testing.assert_close(ratios, reference_ratios(model, prompt, generated, stride), atol=1e-5, rtol=1e-4)
    assert ratios.numel() == sum(g % stride != 0 for g in range(11))
    alpha = introspective_acceptance(model, prompt, generated, MASK, stride)
    assert alpha == pytest.approx(float(ratios.mean())) and 0 < alpha <= 1
    with pytest.raises(ValueError, match="at least 2 generated"):
        introspective_acceptance(model, prompt, generated[:1], MASK, stride)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="decoder.mode"):
        isd(mode="beam")
    with pytest.raises(ConfigError, match="decoder.draft_mode"):
        isd(draft_mode="top2")
    with pytest.raises(ConfigError, match="decoder.stride"):
        isd(stride=1)
    with pytest.raises(ConfigError, match="decoder.tau"):
        isd(tau=-0.5)
    with pytest.raises(ConfigError, match="decoder.temperature"):
        isd(mode="sample", temperature=0.0)
    model = tiny_model(VOCAB)
    with pytest.raises(ConfigError, match="pardec.mask_token_id"):
        isd(stride=2).decode_one(model, [1, 2], NO_EOS, 0)
    with_mask(model)
    with pytest.raises(ConfigError, match="pardec.isd_stride"):
        isd().decode_one(model, [1, 2], NO_EOS, 0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="sdpa"):
        isd(stride=2).decode_one(model, [1, 2], NO_EOS, 0)


@pytest.mark.parametrize("choice", ["isd_greedy", "isd_sample"])
def test_decoder_recipes_compose_and_validate(choice):
    import pardec.cli.validate  # noqa: F401  (registers the validate_schema config node)

    recipes = Path(__file__).resolve().parents[1] / "pardec" / "recipes"
    first_line = (recipes / "decoder" / f"{choice}.yaml").read_text().splitlines()[0]
    assert first_line.startswith(f"# python -m pardec.cli.validate checkpoint=<dir> decoder={choice}")
    with initialize_config_dir(config_dir=str(recipes), version_base="1.3"):
        cfg = validate_validate_config(compose("validate", overrides=["checkpoint=/x", f"decoder={choice}",
                                                                      "decoder.stride=4"]))
    assert cfg.decoder.name == "isd" and cfg.decoder.stride == 4
    assert cfg.decoder.mode == {"isd_greedy": "greedy", "isd_sample": "sample"}[choice]
    with initialize_config_dir(config_dir=str(recipes), version_base="1.3"), pytest.raises(ConfigError, match="strid"):
        overrides = ["checkpoint=/x", f"decoder={choice}", "+decoder.strid=4"]
        validate_validate_config(compose("validate", overrides=overrides))


def test_evaluate_reports_isd_acceptance_and_tpf():
    tok = tiny_tokenizer(extra_tokens=("<|mask|>",))
    model = tiny_model(len(tok))
    model.config.pardec = {"mask_token_id": tok.convert_tokens_to_ids("<|mask|>"), "isd_stride": 3}
    rows = datasets.Dataset.from_list(EVAL_ROWS[:3])
    result = evaluate(model, tok, rows, {"name": "isd", "max_new_tokens": 6}, progress=False)
    m = result.metrics
    assert m["agreement_exact"] == 1.0  # greedy ISD == AR greedy
    assert m["isd_stride"] == 3 and m["isd_distribution_exact"] is True
    assert m["isd_tpf_measured"] == m["tpf"]
    assert {"isd_P_1", "isd_P_2", "isd_accept_rate_1", "isd_tpf_predicted"} <= set(m)
    assert isinstance(build_decoder({"name": "isd"}, tok), ISDDecoder)
