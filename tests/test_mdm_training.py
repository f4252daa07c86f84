"""MDM recipe: masks against brute-force loops, the packed batch, packed == separate forwards on each
backend, a bidirectional forward is not a causal one, the loss against a naive per-token loop."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import Qwen3Config, Qwen3ForCausalLM

from pardec.common.constants import IGNORE_INDEX
from pardec.data_pipelines.mdm_batch import build_mdm_batch, cart_weights
from pardec.losses.mdm import mdm_loss
from pardec.masks.core import AttentionSpec, dense_additive_mask, dense_bool_mask, flex_block_mask
from pardec.masks.idlm import X0, XT
from pardec.masks.mdm import bidirectional_mask, block_causal_mask
from pardec.methods.base import forward_logits

torch.set_num_threads(1)

VOCAB, MASK_ID, EOS, PAD = 48, 47, 0, 0

# -- masks -----------------------------------------------------------------------------------------

# A slot is (sample, position, prompt_len) or None (padding).
Slot = tuple[int, int, int] | None


def slots_of(rows: list[list[tuple[int, int]]], seq: int, shuffle: int | None) -> list[list[Slot]]:
    """Rows of samples given as (length, prompt_len), padded to ``seq``, optionally shuffled."""
    out = []
    for row in rows:
        slots: list[Slot] = [(s, p, pl) for s, (n, pl) in enumerate(row) for p in range(n)]
        slots += [None] * (seq - len(slots))
        if shuffle is not None:
            random.Random(shuffle).shuffle(slots)
        out.append(slots)
    return out


def block_of(slot: Slot, block: int) -> int:
    _, p, pl = slot
    return 0 if p < pl else 1 + (p - pl) // block


def rule(kind: str, q: Slot, kv: Slot, i: int, j: int, block: int) -> bool:
    if q is None or kv is None:
        return i == j
    if q[0] != kv[0]:
        return False
    return True if kind == "bidirectional" else block_of(kv, block) <= block_of(q, block)


def metadata(slots, block):
    seg = torch.tensor([[-1 if s is None else s[0] for s in row] for row in slots])
    blocks = torch.tensor([[0 if s is None else block_of(s, block) for s in row] for row in slots])
    return seg, blocks


def spec_of(kind, slots, block):
    seg, blocks = metadata(slots, block)
    if kind == "bidirectional":
        return AttentionSpec(bidirectional_mask, {"segment_ids": seg})
    return AttentionSpec(block_causal_mask, {"segment_ids": seg, "block_ids": blocks})


CASES = [([[(6, 2)]], 8, 2), ([[(5, 1), (3, 3)], [(7, 4)]], 10, 3), ([[(4, 0), (4, 2), (1, 1)], [(2, 1)]], 11, 1)]


@pytest.mark.parametrize("kind", ["bidirectional", "block"])
@pytest.mark.parametrize("rows,seq,block", CASES)
@pytest.mark.parametrize("shuffle", [None, 5])
def test_masks_match_brute_force(kind, rows, seq, block, shuffle):
    slots = slots_of(rows, seq, shuffle)
    spec = spec_of(kind, slots, block)
    expected = torch.tensor([[[rule(kind, r[i], r[j], i, j, block) for j in range(seq)] for i in range(seq)]
                             for r in slots])
    assert torch.equal(dense_bool_mask(spec.mask_mod(), len(rows), seq, seq), expected)
    additive = dense_additive_mask(spec)
    assert additive.dtype == torch.float32 and torch.equal(additive[:, 0] == 0, expected)


def _diagram(doc: str, names: list[str]) -> torch.Tensor:
    rows = [line.split() for line in doc.splitlines() if line.split() and line.split()[0] in names]
    return torch.tensor([[c == "x" for c in row[1:]] for row in rows])


def test_docstring_diagrams_are_the_masks():
    bidi = spec_of("bidirectional", slots_of([[(3, 1), (2, 1)]], 6, None), 2)
    drawn = _diagram(bidirectional_mask.__doc__, ["a0", "a1", "a2", "b0", "b1", "pad"])
    assert torch.equal(dense_bool_mask(bidi.mask_mod(), 1, 6, 6)[0], drawn)
    block = spec_of("block", slots_of([[(6, 2)]], 6, None), 2)
    drawn = _diagram(block_causal_mask.__doc__, ["p0", "p1", "a0", "a1", "a2", "a3"])
    assert torch.equal(dense_bool_mask(block.mask_mod(), 1, 6, 6)[0], drawn)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", ["bidirectional", "block"])
def test_flex_block_mask_matches_dense(kind):
    rows, seq, block = CASES[1]
    spec = spec_of(kind, slots_of(rows, seq, 3), block)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(rows), 2, seq, 8, generator=gen) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_additive_mask(spec))
    tiled = create_block_mask(spec.mask_mod(), len(rows), None, seq, seq, device="cpu", BLOCK_SIZE=4, _compile=False)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=tiled), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=flex_block_mask(spec, compile=False)), expected,
                               atol=1e-5, rtol=1e-5)


# -- batch -----------------------------------------------------------------------------------------


def random_samples(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(3, 12)
        ids = [rng.randint(1, VOCAB - 2) for _ in range(length - 1)] + [EOS]
        out.append({"input_ids": ids, "prompt_len": rng.randint(0, length - 1)})
    return out


def build(samples, seed=0, **kw):
    kw = {"mask_token_id": MASK_ID, "pack_length": 24, "pad_token_id": PAD, "eos_token_id": EOS, **kw}
    return build_mdm_batch(samples, generator=torch.Generator().manual_seed(seed), **kw)


def test_batch_masks_answers_only_and_shifts_labels():
    samples = random_samples(8, seed=1)
    batch = build(samples, weighting="linear")
    seg = batch["attention"].metadata["segment_ids"]
    n_seen = 0
    for r in range(seg.shape[0]):
        for s in range(int(seg[r].max()) + 1):
            idx = (seg[r] == s).nonzero().flatten()
            sample_id = int(batch["sample_ids"][r, idx[0]])
            sample = samples[sample_id]
            ids, p_len = torch.tensor(sample["input_ids"]), sample["prompt_len"]
            noisy = batch["input_ids"][r, idx]
            masked = noisy == MASK_ID
            assert torch.equal(batch["position_ids"][r, idx], torch.arange(ids.numel()))
            assert not masked[: max(p_len, 1)].any()  # the prompt (and position 0) stay clean
            assert torch.equal(noisy[~masked], ids[~masked])
            for i in range(ids.numel()):
                target = int(ids[i + 1]) if i + 1 < ids.numel() and masked[i + 1] else IGNORE_INDEX
                assert int(batch["labels"][r, idx[i]]) == target
                weight = 1.0 / float(batch["t"][sample_id]) if target != IGNORE_INDEX else 0.0
                assert math.isclose(float(batch["weights"][r, idx[i]]), weight, rel_tol=1e-6)
            assert int(batch["n_answer"][sample_id]) == ids.numel() - max(p_len, 1)
            n_seen += 1
    assert n_seen == len(samples)
    assert torch.all((batch["t"] >= 1e-3) & (batch["t"] <= 1))
    pad = seg < 0
    assert torch.all(batch["labels"][pad] == IGNORE_INDEX) and torch.all(batch["weights"][pad] == 0)


def test_mask_ratio_follows_t():
    """Over many samples the masked fraction of each sample's answer averages t."""
    samples = [{"input_ids": list(range(1, 41)) + [EOS], "prompt_len": 1} for _ in range(400)]
    batch = build(samples, pack_length=41)
    frac = (batch["input_ids"] == MASK_ID).sum(1).float() / 40  # one sample per row
    assert torch.allclose(frac.mean(), batch["t"].mean(), atol=0.02)
    assert float(torch.corrcoef(torch.stack([frac, batch["t"]]))[0, 1]) > 0.9


def test_suffix_masking_masks_a_future_and_keeps_the_weight_total():
    """suffix_mask_prob=1: every answer is all-masked from some cut on (and only randomly before it),
    each sample's 1/t_eff weights sum to its maskable-token count; the cut is uniform (both ends seen)."""
    samples = [{"input_ids": list(range(1, 13)) + [EOS], "prompt_len": 3} for _ in range(300)]
    batch = build(samples, pack_length=13, suffix_mask_prob=1.0)
    cuts = set()
    for r in range(len(samples)):  # one sample per row
        masked = (batch["input_ids"][r] == MASK_ID).tolist()
        assert not any(masked[:3])
        first_clean_from_end = max((i for i in range(13) if not masked[i]), default=2)
        cut = first_clean_from_end + 1
        assert all(masked[cut:]) and cut <= 12
        cuts.add(cut)
        n_masked = sum(masked)
        weights = batch["weights"][r]
        assert math.isclose(float(weights.sum()), 10.0, rel_tol=1e-5)  # sum of 1/t_eff = n_answer
        assert torch.allclose(weights[weights > 0], torch.tensor(10.0 / n_masked))
    assert {3, 12} <= cuts  # the whole answer, and just the last token


def test_suffix_masking_off_keeps_uniform_masking_stream():
    samples = random_samples(8, seed=2)
    plain, off = build(samples, seed=5), build(samples, seed=5, suffix_mask_prob=0.0)
    for key in ("input_ids", "labels", "weights", "t"):
        assert torch.equal(plain[key], off[key])
    with pytest.raises(ValueError, match="suffix_mask_prob"):
        build(samples, suffix_mask_prob=1.5)


def test_cart_weights_brute_force():
    clean = torch.tensor([True, False, False, True, False, True, False])
    p = 0.3
    got = cart_weights(clean, p)
    for i in range(clean.numel()):
        want = sum(0.5 * p * (1 - p) ** (abs(i - j) - 1) for j in range(clean.numel()) if clean[j] and j != i)
        assert math.isclose(float(got[i]), want, rel_tol=1e-6)


def test_eos_padding_of_answers():
    samples = [{"input_ids": [5, 6, 7, EOS], "prompt_len": 2}, {"input_ids": [5, 9, EOS], "prompt_len": 1}]
    batch = build(samples, pad_answer_to=4, eps=0.999)  # t ~ 1: every answer token masked
    assert batch["n_answer"].tolist() == [4, 4]
    labels = batch["labels"][0]
    assert labels[:6].tolist() == [IGNORE_INDEX, 7, EOS, EOS, EOS, IGNORE_INDEX]
    with pytest.raises(ValueError, match="pad_answer_to=1"):
        build(samples, pad_answer_to=1)


def clean_context_parts(batch, r, sample_id):
    """Slot indices of one sample's x_0 and x_t streams in row r (each in position order)."""
    stream = batch["attention"].metadata["stream"][r]
    mine = batch["sample_ids"][r] == sample_id
    return (mine & (stream == X0)).nonzero().flatten(), (mine & (stream == XT)).nonzero().flatten()


@pytest.mark.parametrize("weighting", ["linear", "cart"])
def test_clean_context_batch_matches_brute_force_layout(weighting):
    """[x_0 | x_t] per sample: x_0 = the clean sample, x_t = its noisy answer at the same positions;
    each masked token is predicted exactly once, from its predecessor's x_t slot inside a block and
    from its predecessor's x_0 slot when it opens a block; weights 1/t or CART over what the query sees."""
    samples = random_samples(8, seed=6) + [{"input_ids": [4, EOS], "prompt_len": 2},  # an empty answer
                                           {"input_ids": [5, 6, 7, 8, EOS], "prompt_len": 0}]  # no prompt
    block = 3
    batch = build(samples, attention="block", block_size=block, clean_context=True, weighting=weighting,
                  pack_length=40, seed=3)
    for r in range(batch["input_ids"].shape[0]):
        for sample_id in batch["sample_ids"][r].unique().tolist():
            if sample_id < 0:
                continue
            ids, p_len = samples[sample_id]["input_ids"], samples[sample_id]["prompt_len"]
            n = len(ids)
            clean, noisy = clean_context_parts(batch, r, sample_id)
            assert batch["input_ids"][r, clean].tolist() == ids
            assert batch["position_ids"][r, clean].tolist() == list(range(n))
            assert batch["position_ids"][r, noisy].tolist() == list(range(p_len, n))
            x_t = batch["input_ids"][r, noisy].tolist()
            masked = [False] * p_len + [tok == MASK_ID for tok in x_t]
            assert all(x_t[j - p_len] == ids[j] for j in range(p_len, n) if not masked[j])
            assert not any(masked[: max(p_len, 1)])
            blocks = [0 if p < p_len else 1 + (p - p_len) // block for p in range(n)]
            t = float(batch["t"][sample_id])
            want_labels = {(s, p): IGNORE_INDEX for s in ("x0", "xt") for p in range(n)}
            want_weights = {key: 0.0 for key in want_labels}
            for j in range(1, n):
                if not masked[j]:
                    continue
                opens = blocks[j - 1] != blocks[j]
                key = ("x0" if opens else "xt", j - 1)
                sees = [m for m in range(n) if blocks[m] < blocks[j] or
                        (not opens and blocks[m] == blocks[j] and not masked[m])]
                want_labels[key] = ids[j]
                want_weights[key] = 1.0 / t if weighting == "linear" else sum(
                    0.5 * 0.3 * 0.7 ** (abs(j - m) - 1) for m in sees if m != j)
            for stream, slots, first in (("x0", clean, 0), ("xt", noisy, p_len)):
                for k, slot in enumerate(slots.tolist()):
                    assert int(batch["labels"][r, slot]) == want_labels[(stream, first + k)]
                    assert math.isclose(float(batch["weights"][r, slot]), want_weights[(stream, first + k)],
                                        rel_tol=1e-5, abs_tol=1e-9)
            assert int(batch["n_answer"][sample_id]) == n - max(p_len, 1)
    with pytest.raises(ValueError, match="clean_context needs block-causal"):
        build(samples, clean_context=True)


# -- packed forward ----------------------------------------------------------------------------------


def tiny(impl: str):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    config._attn_implementation = impl
    return Qwen3ForCausalLM(config).eval()


def explicit_mask(allowed: torch.Tensor) -> torch.Tensor:
    """[q, kv] bool -> [1, 1, q, kv] float additive, built by hand."""
    out = torch.full((1, 1, *allowed.shape), torch.finfo(torch.float32).min)
    out[0, 0][allowed] = 0.0
    return out


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind,block", [("bidirectional", None), ("block", 3)])
def test_packed_forward_equals_separate_forwards(impl, kind, block):
    samples = random_samples(6, seed=3)
    model = tiny(impl)
    batch = build(samples, attention=kind, block_size=block)
    with torch.no_grad():
        logits = forward_logits(model, batch)  # [r, s, V]
    assert batch["input_ids"].shape[0] >= 2
    for r in range(batch["input_ids"].shape[0]):
        for sample_id in batch["sample_ids"][r].unique().tolist():
            if sample_id < 0:
                continue
            idx = (batch["sample_ids"][r] == sample_id).nonzero().flatten()
            n, p_len = idx.numel(), samples[sample_id]["prompt_len"]
            if kind == "bidirectional":
                allowed = torch.ones(n, n, dtype=torch.bool)
            else:
                blocks = [0 if p < p_len else 1 + (p - p_len) // block for p in range(n)]
                allowed = torch.tensor([[blocks[j] <= blocks[i] for j in range(n)] for i in range(n)])
            with torch.no_grad():
                ref = model(input_ids=batch["input_ids"][r, idx][None], attention_mask=explicit_mask(allowed),
                            position_ids=torch.arange(n)[None]).logits[0]
            torch.testing.assert_close(logits[r, idx], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_clean_context_forward_equals_the_decoding_views(impl):
    """One packed [x_0 | x_t] forward gives, at each x_t slot of block B, the logits of a forward over
    what semi-AR decoding feeds for block B (the clean blocks before it, then the noisy block, under
    the block-causal mask), and at each x_0 slot those of the block-causal forward of the clean sample."""
    samples = random_samples(5, seed=7)
    block = 3
    model = tiny(impl)
    batch = build(samples, attention="block", block_size=block, clean_context=True, pack_length=48, seed=1)
    assert batch["input_ids"].shape[0] >= 2
    with torch.no_grad():
        logits = forward_logits(model, batch)  # [r, s, V]

    def block_causal_forward(tokens, positions, blocks):
        allowed = torch.tensor([[b_kv <= b_q for b_kv in blocks] for b_q in blocks])
        with torch.no_grad():
            return model(input_ids=torch.tensor([tokens]), attention_mask=explicit_mask(allowed),
                         position_ids=torch.tensor([positions])).logits[0]

    for r in range(batch["input_ids"].shape[0]):
        for sample_id in batch["sample_ids"][r].unique().tolist():
            if sample_id < 0:
                continue
            ids, p_len = samples[sample_id]["input_ids"], samples[sample_id]["prompt_len"]
            blocks = [0 if p < p_len else 1 + (p - p_len) // block for p in range(len(ids))]
            clean, noisy = clean_context_parts(batch, r, sample_id)
            ref = block_causal_forward(ids, list(range(len(ids))), blocks)
            torch.testing.assert_close(logits[r, clean], ref, atol=1e-5, rtol=1e-5)
            x_t = batch["input_ids"][r, noisy].tolist()
            for b in sorted(set(blocks[p_len:])):
                start = blocks.index(b)
                end = start + blocks.count(b)
                tokens = ids[:start] + x_t[start - p_len:end - p_len]
                ref = block_causal_forward(tokens, list(range(end)), blocks[:end])
                torch.testing.assert_close(logits[r, noisy[start - p_len:end - p_len]], ref[start:end],
                                           atol=1e-5, rtol=1e-5)


def test_bidirectional_forward_is_not_causal():
    """The explicit bidirectional mask changes the output; without it SDPA would run causally."""
    model = tiny("sdpa")
    ids = torch.tensor([[3, 4, MASK_ID, MASK_ID, 9, 10]])
    spec = AttentionSpec(bidirectional_mask, {"segment_ids": torch.zeros_like(ids)})
    batch = {"input_ids": ids, "position_ids": torch.arange(6)[None], "attention": spec}
    with torch.no_grad():
        bidi = forward_logits(model, batch)[0]
        causal = model(input_ids=ids, position_ids=torch.arange(6)[None]).logits[0]
    # Every position differs: the first sees the future directly, the last through the layer below.
    assert all(not torch.allclose(bidi[i], causal[i], atol=1e-4) for i in range(6))
    # The explicit causal mask reproduces the mask-less forward, so the difference is the mask's.
    causal_mask = explicit_mask(torch.ones(6, 6, dtype=torch.bool).tril())
    with torch.no_grad():
        explicit = model(input_ids=ids, position_ids=torch.arange(6)[None], attention_mask=causal_mask).logits[0]
    torch.testing.assert_close(explicit, causal, atol=1e-5, rtol=1e-5)


# -- loss ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighting", ["linear", "cart"])
@pytest.mark.parametrize("normalization", ["batch", "sample"])
def test_loss_equals_naive_per_token_loop(weighting, normalization):
    samples = random_samples(7, seed=4)
    batch = build(samples, weighting=weighting, seed=2)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(*batch["input_ids"].shape, VOCAB, generator=gen, requires_grad=True)
    loss, logs = mdm_loss(logits, batch["labels"], batch["weights"], batch["sample_ids"], batch["n_answer"],
                          normalization)

    # Naive: walk every sample token by token, recompute its weight from the masking pattern.
    per_sample = {}
    for r in range(logits.shape[0]):
        for sample_id in batch["sample_ids"][r].unique().tolist():
            if sample_id < 0:
                continue
            idx = (batch["sample_ids"][r] == sample_id).nonzero().flatten().tolist()
            noisy = batch["input_ids"][r, idx]
            clean = noisy != MASK_ID
            total = 0.0
            for k in range(len(idx) - 1):
                if noisy[k + 1] != MASK_ID:
                    continue
                target = samples[sample_id]["input_ids"][k + 1]
                ce = -torch.log_softmax(logits[r, idx[k]].double(), -1)[target]
                if weighting == "linear":
                    w = 1.0 / float(batch["t"][sample_id])
                else:
                    w = sum(0.5 * 0.3 * 0.7 ** (abs(k + 1 - j) - 1) for j in range(len(idx)) if clean[j] and j != k + 1)
                total += w * ce
            per_sample[sample_id] = total
    n_answer = batch["n_answer"].tolist()
    if normalization == "batch":
        expected = sum(per_sample.values()) / sum(n_answer)
    else:
        kept = [i for i in per_sample if n_answer[i] > 0]
        expected = sum(per_sample[i] / n_answer[i] for i in kept) / len(kept)
    torch.testing.assert_close(loss.double(), torch.as_tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    assert logs["n_targets"] == float((batch["labels"] != IGNORE_INDEX).sum())
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_loss_without_targets_is_a_zero_in_the_graph():
    logits = torch.randn(1, 4, VOCAB, requires_grad=True)
    labels = torch.full((1, 4), IGNORE_INDEX)
    loss, _ = mdm_loss(logits, labels, torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.long), torch.tensor([3]))
    loss.backward()
    assert float(loss) == 0.0 and torch.all(logits.grad == 0)


# -- recipe through the trainer ---------------------------------------------------------------------


@pytest.mark.parametrize("attention,clean_context", [("bidirectional", False), ("block", False), ("block", True)])
def test_recipe_trains_and_export_records_the_conversion(tmp_path, attention, clean_context):
    from pardec.common.metadata import CheckpointMetadata
    from tests.train_utils import run_in_process

    result = run_in_process([f"output_dir={tmp_path}", "recipe=mdm", "model=tiny_qwen3", "trainer.max_steps=3",
                             f"recipe.attention={attention}", "recipe.block_size=8",
                             f"recipe.clean_context={str(clean_context).lower()}"])
    assert result.status == "finished"
    meta = CheckpointMetadata.read(result.export_dir)
    assert meta.recipe == "mdm" and meta.attention == attention and meta.logit_shift is True
    assert meta.mask_token_id is not None
    assert meta.attention_block_size == (8 if attention == "block" else None)


def test_clean_context_without_block_attention_is_a_named_config_error(tmp_path):
    from pardec.common.errors import ConfigError
    from tests.train_utils import run_in_process

    with pytest.raises(ConfigError, match="recipe.clean_context"):
        run_in_process([f"output_dir={tmp_path}", "recipe=mdm", "model=tiny_qwen3", "trainer.max_steps=1",
                        "recipe.attention=bidirectional", "recipe.clean_context=true"])
