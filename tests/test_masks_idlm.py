"""I-DLM and block-diffusion masks against brute-force loops over (q, kv), on every backend path."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from pardec.masks.block_diffusion import block_diffusion_mask
from pardec.masks.core import AttentionSpec, dense_additive_mask, dense_bool_mask, flex_block_mask
from pardec.masks.idlm import idlm_mask

# A slot is (sample, stream, position) with stream "t" (x_t) or "c" (x_0), or None for padding.
Slot = tuple[int, str, int] | None


def idlm_rule(q: Slot, kv: Slot, q_slot: int, kv_slot: int, block: int) -> bool:
    if q is None or kv is None:
        return q_slot == kv_slot
    (qs, q_stream, qp), (ks, kv_stream, kp) = q, kv
    if qs != ks:
        return False
    if q_stream == "t" and kv_stream == "t":
        return qp // block == kp // block and kp <= qp
    if q_stream == "t" and kv_stream == "c":
        return kp // block < qp // block
    if q_stream == "c" and kv_stream == "c":
        return kp <= qp
    return False  # clean never sees noisy


def block_diffusion_rule(q: Slot, kv: Slot, q_slot: int, kv_slot: int, block: int) -> bool:
    if q is None or kv is None:
        return q_slot == kv_slot
    (qs, q_stream, qp), (ks, kv_stream, kp) = q, kv
    if qs != ks:
        return False
    if q_stream == "t" and kv_stream == "t":
        return qp // block == kp // block
    if q_stream == "t" and kv_stream == "c":
        return kp // block < qp // block
    if q_stream == "c" and kv_stream == "c":
        return kp // block <= qp // block
    return False


def layout(rows: list[list[int]], seq: int, shuffle_seed: int | None = None) -> list[list[Slot]]:
    """Rows of samples (given by length), each as [x_t | x_0], padded to ``seq``; optionally shuffled."""
    out = []
    for row in rows:
        slots: list[Slot] = []
        for sample, length in enumerate(row):
            slots += [(sample, "t", p) for p in range(length)] + [(sample, "c", p) for p in range(length)]
        slots += [None] * (seq - len(slots))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(slots)
        out.append(slots)
    return out


def metadata(slots: list[list[Slot]], block: int, with_positions: bool) -> dict[str, torch.Tensor]:
    seg = torch.tensor([[-1 if s is None else s[0] for s in row] for row in slots])
    stream = torch.tensor([[1 if s is None or s[1] == "c" else 0 for s in row] for row in slots])
    pos = torch.tensor([[0 if s is None else s[2] for s in row] for row in slots])
    meta = {"segment_ids": seg, "stream": stream, "block_ids": pos // block}
    if with_positions:
        meta["position_ids"] = pos
    return meta


def reference(slots: list[list[Slot]], rule, block: int) -> torch.Tensor:
    return torch.tensor(
        [[[rule(row[i], row[j], i, j, block) for j in range(len(row))] for i in range(len(row))] for row in slots]
    )


MASKS = {
    "idlm": (idlm_mask, idlm_rule, True),
    "block_diffusion": (block_diffusion_mask, block_diffusion_rule, False),
}
CASES = [  # (rows of sample lengths, pack length, block size)
    ([[6]], 12, 2),
    ([[5, 3], [7]], 20, 3),
    ([[4, 4, 1], [2]], 19, 1),
    ([[9, 2], [3, 3, 3]], 24, 4),
]


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("rows,seq,block", CASES)
@pytest.mark.parametrize("shuffle_seed", [None, 7])
def test_dense_mask_matches_brute_force(name, rows, seq, block, shuffle_seed):
    factory, rule, with_positions = MASKS[name]
    slots = layout(rows, seq, shuffle_seed)
    spec = AttentionSpec(factory, metadata(slots, block, with_positions))
    expected = reference(slots, rule, block)  # [b, s, s]

    allowed = dense_bool_mask(spec.mask_mod(), len(rows), seq, seq)
    assert torch.equal(allowed, expected)

    additive = dense_additive_mask(spec)  # [b, 1, s, s]
    assert additive.dtype == torch.float32 and additive.shape == (len(rows), 1, seq, seq)
    assert torch.equal(additive[:, 0] == 0, expected)
    assert torch.all(additive[:, 0][~expected] == torch.finfo(torch.float32).min)


def _diagram(docstring: str) -> torch.Tensor:
    rows = [line.split() for line in docstring.splitlines()
            if line.strip()[:2] in {f"{s}{i}" for s in "tc" for i in range(6)}]
    return torch.tensor([[c == "x" for c in row[1:]] for row in rows])


@pytest.mark.parametrize("name", sorted(MASKS))
def test_docstring_diagram_is_the_mask(name):
    factory, _, with_positions = MASKS[name]
    slots = layout([[6]], 12)
    spec = AttentionSpec(factory, metadata(slots, 2, with_positions))
    drawn = _diagram(factory.__doc__)
    assert drawn.shape == (12, 12)
    assert torch.equal(dense_bool_mask(spec.mask_mod(), 1, 12, 12)[0], drawn)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("rows,seq,block", CASES[1:])
def test_flex_attention_matches_dense_on_cpu(name, rows, seq, block):
    """FlexAttention (uncompiled, CPU) with the BlockMask built from the same predicate equals SDPA
    with the dense mask; small BLOCK_SIZE so partial and skipped tiles are both exercised."""
    factory, _, with_positions = MASKS[name]
    spec = AttentionSpec(factory, metadata(layout(rows, seq, shuffle_seed=3), block, with_positions))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(rows), 2, seq, 8, generator=gen) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_additive_mask(spec))

    tiled = create_block_mask(spec.mask_mod(), len(rows), None, seq, seq, device="cpu", BLOCK_SIZE=4, _compile=False)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=tiled), expected, atol=1e-5, rtol=1e-5)
    default = flex_block_mask(spec, compile=False)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=default), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(MASKS))
def test_compiled_flex_block_mask_on_gpu(name):
    factory, _, with_positions = MASKS[name]
    rows, seq, block = [[70, 30], [90]], 256, 4
    spec = AttentionSpec(factory, metadata(layout(rows, seq), block, with_positions)).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(len(rows), 2, seq, 16, device="cuda", generator=gen) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_additive_mask(spec))
    out = torch.compile(flex_attention)(q, k, v, block_mask=flex_block_mask(spec))
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
