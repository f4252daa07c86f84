"""Jacobi Forcing NC / NC-IC masks against brute-force loops over (q, kv), their docstring diagrams,
and FlexAttention (built from the same predicate) against SDPA with the dense mask."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from pardec.masks.core import AttentionSpec, dense_additive_mask, dense_bool_mask, flex_block_mask
from pardec.masks.jacobi import CLEAN, NOISY, PROMPT, jacobi_nc_ic_mask, jacobi_nc_mask

# A slot is (sample, stream, block, position) with stream "p" / "k" (noisy) / "c" (clean) and
# block -1 on the prompt, or None for padding.
Slot = tuple[int, str, int, int] | None
STREAM_IDS = {"p": PROMPT, "k": NOISY, "c": CLEAN}


def nc_rule(q: Slot, kv: Slot, q_slot: int, kv_slot: int, window: int) -> bool:
    if q is None or kv is None:
        return q_slot == kv_slot
    (qs, q_stream, qb, qp), (ks, kv_stream, kb, kp) = q, kv
    if qs != ks:
        return False
    if q_stream == "p":
        return kv_stream == "p" and kp <= qp
    if kv_stream == "p":
        return True
    if kv_stream != q_stream:
        return False
    return kb < qb or (kb == qb and kp <= qp)


def nc_ic_rule(q: Slot, kv: Slot, q_slot: int, kv_slot: int, window: int) -> bool:
    if q is None or kv is None or q[1] != "k" or kv[1] == "p" or q[0] != kv[0]:
        return nc_rule(q, kv, q_slot, kv_slot, window)
    qb, kb = q[2], kv[2]
    window_start = qb // window * window
    if kv[1] == "c":
        return kb < window_start  # clean blocks of the preceding windows
    return window_start <= kb and (kb < qb or (kb == qb and kv[3] <= q[3]))


def layout(rows: list[list[tuple[int, int]]], n: int, seq: int, shuffle_seed: int | None = None) -> list[list[Slot]]:
    """Rows of samples given as (prompt length, blocks), each [prompt][k_0][c_0]..., padded to ``seq``."""
    out = []
    for row in rows:
        slots: list[Slot] = []
        for sample, (p, blocks) in enumerate(row):
            slots += [(sample, "p", -1, i) for i in range(p)]
            for j in range(blocks):
                for stream in "kc":
                    slots += [(sample, stream, j, p + j * n + o) for o in range(n)]
        slots += [None] * (seq - len(slots))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(slots)
        out.append(slots)
    return out


def metadata(slots: list[list[Slot]], window: int | None) -> dict[str, torch.Tensor]:
    seg = torch.tensor([[-1 if s is None else s[0] for s in row] for row in slots])
    stream = torch.tensor([[PROMPT if s is None else STREAM_IDS[s[1]] for s in row] for row in slots])
    block = torch.tensor([[-1 if s is None else s[2] for s in row] for row in slots])
    pos = torch.tensor([[0 if s is None else s[3] for s in row] for row in slots])
    meta = {"segment_ids": seg, "stream": stream, "block_ids": block, "position_ids": pos}
    if window is not None:
        meta["window_ids"] = torch.where(block >= 0, block // window, -1)
    return meta


def reference(slots: list[list[Slot]], rule, window: int) -> torch.Tensor:
    return torch.tensor(
        [[[rule(row[i], row[j], i, j, window) for j in range(len(row))] for i in range(len(row))] for row in slots]
    )


MASKS = {"nc": (jacobi_nc_mask, nc_rule, False), "nc_ic": (jacobi_nc_ic_mask, nc_ic_rule, True)}
CASES = [  # (rows of (prompt length, blocks), block size, row length, window)
    ([[(2, 2)]], 2, 10, 1),
    ([[(3, 3), (1, 1)], [(4, 2)]], 2, 24, 2),
    ([[(1, 4)], [(2, 1), (2, 1), (1, 2)]], 1, 14, 3),
    ([[(5, 3)]], 3, 26, 2),
]


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("rows,n,seq,window", CASES)
@pytest.mark.parametrize("shuffle_seed", [None, 5])
def test_dense_mask_matches_brute_force(name, rows, n, seq, window, shuffle_seed):
    factory, rule, windowed = MASKS[name]
    slots = layout(rows, n, seq, shuffle_seed)
    spec = AttentionSpec(factory, metadata(slots, window if windowed else None))
    expected = reference(slots, rule, window)  # [b, s, s]

    assert torch.equal(dense_bool_mask(spec.mask_mod(), len(rows), seq, seq), expected)
    additive = dense_additive_mask(spec)  # [b, 1, s, s]
    assert additive.dtype == torch.float32 and additive.shape == (len(rows), 1, seq, seq)
    assert torch.equal(additive[:, 0] == 0, expected)
    assert torch.all(additive[:, 0][~expected] == torch.finfo(torch.float32).min)


def test_nc_ic_limits():
    """NC-IC with a window covering every block is NC; with w = 1 every noisy block sees only clean
    earlier blocks (the CLLM consistency mask)."""
    slots = layout([[(2, 4)]], 2, 18)
    nc = dense_bool_mask(AttentionSpec(jacobi_nc_mask, metadata(slots, None)).mask_mod(), 1, 18, 18)
    wide = dense_bool_mask(AttentionSpec(jacobi_nc_ic_mask, metadata(slots, 4)).mask_mod(), 1, 18, 18)
    assert torch.equal(nc, wide)
    narrow = dense_bool_mask(AttentionSpec(jacobi_nc_ic_mask, metadata(slots, 1)).mask_mod(), 1, 18, 18)[0]
    for i, q in enumerate(slots[0]):
        for j, kv in enumerate(slots[0]):
            if q[1] == "k" and kv[1] != "p":
                clean_before = kv[1] == "c" and kv[2] < q[2]
                own_block_causal = kv[1] == "k" and kv[2] == q[2] and kv[3] <= q[3]
                assert narrow[i, j] == (clean_before or own_block_causal)


def _diagram(docstring: str, labels: list[str]) -> torch.Tensor:
    rows = [line.split() for line in docstring.splitlines() if line.split() and line.split()[0] in labels]
    assert [r[0] for r in rows] == labels
    return torch.tensor([[c == "x" for c in row[1:]] for row in rows])


@pytest.mark.parametrize("name,rows,n,window", [("nc", [[(2, 2)]], 2, None), ("nc_ic", [[(1, 3)]], 2, 2)])
def test_docstring_diagram_is_the_mask(name, rows, n, window):
    factory = MASKS[name][0]
    p, blocks = rows[0][0]
    seq = p + 2 * blocks * n
    slots = layout(rows, n, seq)
    labels = [f"{'p' if s[1] == 'p' else 'n' if s[1] == 'k' else 'c'}{s[3]}" for s in slots[0]]
    drawn = _diagram(factory.__doc__, labels)
    spec = AttentionSpec(factory, metadata(slots, window))
    assert torch.equal(dense_bool_mask(spec.mask_mod(), 1, seq, seq)[0], drawn)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("rows,n,seq,window", CASES[1:])
def test_flex_attention_matches_dense_on_cpu(name, rows, n, seq, window):
    factory, _, windowed = MASKS[name]
    spec = AttentionSpec(factory, metadata(layout(rows, n, seq, shuffle_seed=3), window if windowed else None))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(rows), 2, seq, 8, generator=gen) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_additive_mask(spec))
    tiled = create_block_mask(spec.mask_mod(), len(rows), None, seq, seq, device="cpu", BLOCK_SIZE=4, _compile=False)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=tiled), expected, atol=1e-5, rtol=1e-5)
    default = flex_block_mask(spec, compile=False)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=default), expected, atol=1e-5, rtol=1e-5)
    small = flex_block_mask(spec, compile=False, block_size=8)
    assert small.BLOCK_SIZE == (8, 8)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=small), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(MASKS))
def test_compiled_flex_block_mask_on_gpu(name):
    factory, _, windowed = MASKS[name]
    rows, n, seq = [[(40, 5), (20, 3)], [(60, 8)]], 8, 256
    spec = AttentionSpec(factory, metadata(layout(rows, n, seq), 2 if windowed else None)).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(len(rows), 2, seq, 16, device="cuda", generator=gen) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_additive_mask(spec))
    out = torch.compile(flex_attention)(q, k, v, block_mask=flex_block_mask(spec))
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
