"""Packed Jacobi Forcing training batches: ``[prompt][k_0][c_0][k_1][c_1]...``
(docs/methods/jacobi_forcing.md#packing, paper App. C).

Per sample with prompt length P, block size n and N blocks: k_j is block j's chosen noisy state
(``pardec.data_pipelines.jacobi_noise``), c_j its fixed point; the sample takes P + 2Nn slots and k_j, c_j
both take positions P + j*n + o (o = 0..n-1). ``valid_lens[j]`` is n except in the block holding
EOS (tokens up to and including EOS); slots after EOS are inputs only, never supervised. Several
samples are packed greedily per row (segment ids) and rows are padded to ``pack_length`` (with
``pad_to=longest``, to the longest row).

One forward with the NC (or NC-IC) mask of ``pardec.masks.jacobi`` gives every logit both losses need.

**Layout.** ``layout="interleaved"`` (default) is ``[prompt][k_0][c_0][k_1][c_1]...``
(docs/methods/jacobi_forcing.md#packing).
``layout="streams"`` lays each stream out contiguously, ``[prompt][k_0 ... k_{N-1}][c_0 ... c_{N-1}]``.
The masks read only per-token metadata (stream, block, position), so both layouts give the same
attention, the same logits per (stream, block, offset) and the same losses (tested). They differ
in FlexAttention's work, which is counted in whole 128 x 128 tiles. Under NC each stream of the
``streams`` layout is one causal run, so about half of plain causal attention's tiles are computed
over the row. The interleaved layout computes about as many tiles as causal attention, half of them
partial (``pardec/benchmarks/mask_tiles.py``). The diagrams below are drawn for the default layout.

**AR labels** (logit shift; clean stream plus the prompt's last slot)::

    slot            ... p_{P-1} | k_0 ... | c_0[0] ... c_0[n-1] | k_1 ... | c_1[0] ...
    label           ... c_0[0]  | -   ... | c_0[1] ... c_1[0]   | -   ... | c_1[1] ...

* the prompt's last token (it sees the prompt only) predicts c_0[0], the first answer token;
* clean slot (j, o) predicts c_j[o + 1] for o < n - 1: its query sees the prompt and c_0..c_j up
  to o, exactly the causal context of position P + j*n + o;
* the last clean slot of block j predicts c_{j+1}[0], taken from the next *clean* block (in the
  interleaved layout the next buffer slot is k_{j+1}[0]); its query sees prompt + c_0..c_j, so this
  is the plain AR target;
* no target after EOS (the EOS slot itself predicts nothing), none for the last slot of a final
  block cut by the length cap, and none on prompt-to-prompt or noisy slots.

So the clean stream trains exactly the AR loss on the generated answer tokens (EOS included).

**Consistency pairs** (``pc_student_index`` / ``pc_teacher_index``, flat indices into the
``[r * s]`` logits): for block j with first mismatch m (the first offset where k_j differs from
c_j; m >= 1 since both start with the same exact token), the student is the noisy logit at
offset o and the teacher the clean logit at the same offset o, for o = m .. last, where last =
n - 1, or valid_len - 2 in the EOS block (the EOS logit predicts nothing). With the logit shift,
offset o predicts token o + 1 (o = n - 1: the next block's first token), so the pairs are exactly
the predictions whose in-block context contains at least one noisy token (the paper's noisy
context y'_{c:f-1}, Eq. 6); offsets < m have the same in-block context in both streams. A block
whose chosen state is its fixed point (t = 0) has no pair but still counts in ``n_blocks``, the
divisor of the paper's mean over blocks (Eq. 8).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from pardec.common.config_fields import Choice
from pardec.common.constants import IGNORE_INDEX
from pardec.data_pipelines.packing import PAD_SEGMENT, greedy_pack, pad_rows, padded_length
from pardec.masks.core import AttentionSpec
from pardec.masks.jacobi import CLEAN, NOISY, PROMPT, jacobi_nc_ic_mask, jacobi_nc_mask


class JacobiMask(Choice):
    """nc (noise-conditioned) | nc_ic (intra-window clean context)."""

    nc = "nc"
    nc_ic = "nc_ic"


class JacobiLayout(Choice):
    """interleaved ([prompt][k_0][c_0][k_1][c_1]...) | streams (every noisy block, then every clean block)."""

    interleaved = "interleaved"
    streams = "streams"



def sample_length(num_prompt: int, num_blocks: int, block_size: int) -> int:
    """Slots a packed sample takes: P + 2Nn."""
    return num_prompt + 2 * num_blocks * block_size


def build_jacobi_batch(
    samples: Sequence[Mapping[str, Any]],
    *,
    block_size: int,
    pack_length: int,
    pad_token_id: int,
    mask: str = "nc",
    window: int = 1,
    layout: str = "interleaved",
    pad_to: str = "pack_length",
) -> dict[str, Any]:
    """Pack samples into one batch.

    ``samples``: each with ``prompt_ids`` (P >= 1 ids), ``noisy_blocks`` and ``clean_blocks``
    (N lists of ``block_size`` ids) and ``valid_lens`` (N ints in 1..n; only the last may be < n).
    ``mask``: ``nc`` or ``nc_ic``; ``window``: the noise window w (NC-IC's window of blocks);
    ``layout``: ``interleaved`` (docs/methods/jacobi_forcing.md#packing) or ``streams`` (module docstring).
    ``pad_to``: ``pack_length`` or ``longest`` (``pardec.data_pipelines.packing.PadTo``).

    Returns, with r rows and s = ``pack_length`` (``pad_to=longest``: the longest row's slots):

    * ``input_ids``, ``position_ids``, ``labels`` (AR targets, ``-100`` = none): ``[r, s]`` long;
    * ``pc_student_index``, ``pc_teacher_index``: ``[K]`` long, flat indices into ``r * s``;
    * ``n_blocks``: 0-d long, blocks in the batch (the L_pc divisor);
    * ``attention``: the NC / NC-IC ``AttentionSpec``.
    """
    mask, layout = JacobiMask(mask), JacobiLayout(layout)  # ValueError naming the choices
    if block_size < 1 or window < 1:
        raise ValueError(f"block_size and window must be >= 1, got {block_size} and {window}")
    if not samples:
        raise ValueError("build_jacobi_batch got no samples")
    checked = [_checked(i, s, block_size) for i, s in enumerate(samples)]
    lengths = [sample_length(len(p), len(c), block_size) for p, _, c, _ in checked]
    for i, length in enumerate(lengths):
        if length > pack_length:
            raise ValueError(
                f"sample {i}: {length} slots (prompt + 2 x blocks x block_size) > pack_length={pack_length}"
            )
    rows = greedy_pack(lengths, pack_length)
    s = padded_length(rows, lengths, pack_length, pad_to)

    fields = ("input_ids", "position_ids", "labels", "segment_ids", "stream", "block_ids")
    pad = {"input_ids": pad_token_id, "position_ids": 0, "labels": IGNORE_INDEX, "segment_ids": PAD_SEGMENT,
           "stream": PROMPT, "block_ids": -1}
    filled = []
    students, teachers = [], []
    for r, row in enumerate(rows):
        offset = r * s
        parts = []
        for segment, i in enumerate(row):
            part, pairs = _sample_slots(*checked[i], block_size, segment, layout)
            students.append(pairs[0] + offset)
            teachers.append(pairs[1] + offset)
            offset += lengths[i]
            parts.append(part)
        filled.append({k: torch.cat([p[k] for p in parts]) for k in fields})
    batch = pad_rows(filled, pad, s)  # each [r, s]

    metadata = {
        "segment_ids": batch.pop("segment_ids"),
        "stream": batch.pop("stream"),
        "block_ids": batch.pop("block_ids"),
        "position_ids": batch["position_ids"],
    }
    if mask == "nc_ic":
        block_ids = metadata["block_ids"]
        metadata["window_ids"] = torch.where(block_ids >= 0, block_ids // window, -1)
    factory = jacobi_nc_mask if mask == "nc" else jacobi_nc_ic_mask
    batch["attention"] = AttentionSpec(factory, metadata)
    batch["pc_student_index"] = torch.cat(students)
    batch["pc_teacher_index"] = torch.cat(teachers)
    batch["n_blocks"] = torch.tensor(sum(len(c[2]) for c in checked), dtype=torch.long)
    return batch


def _checked(index: int, sample: Mapping[str, Any], n: int):
    """(prompt ``[P]``, noisy ``[N, n]``, clean ``[N, n]``, valid_lens) of one sample, validated."""
    prompt = [int(t) for t in sample["prompt_ids"]]
    noisy, clean = [list(b) for b in sample["noisy_blocks"]], [list(b) for b in sample["clean_blocks"]]
    valid = [int(v) for v in sample["valid_lens"]]
    if not prompt:
        raise ValueError(f"sample {index}: empty prompt_ids; the first answer token is predicted from the prompt")
    if not clean or len(noisy) != len(clean) or len(clean) != len(valid):
        raise ValueError(
            f"sample {index}: noisy_blocks, clean_blocks and valid_lens must describe the same N >= 1 blocks "
            f"(got {len(noisy)}, {len(clean)} and {len(valid)} entries)"
        )
    for j, (k, c, v) in enumerate(zip(noisy, clean, valid)):
        if len(k) != n or len(c) != n:
            raise ValueError(f"sample {index}: block {j} has {len(k)} noisy / {len(c)} clean tokens; block_size is {n}")
        if not 1 <= v <= n or (v < n and j != len(valid) - 1):
            raise ValueError(f"sample {index}: valid_lens[{j}]={v}; expected 1..{n}, and < {n} only in the last block")
        if k[0] != c[0]:
            raise ValueError(f"sample {index}: block {j}'s noisy state starts with {k[0]} but its fixed point with "
                             f"{c[0]}; a Jacobi state's first token is always exact")
    return torch.tensor(prompt), torch.tensor(noisy), torch.tensor(clean), valid


def _sample_slots(
    prompt: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor, valid: list[int], n: int, segment: int,
    layout: str,
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The P + 2Nn slots of one sample (every field ``[P + 2Nn]``) and its consistency pairs as
    indices relative to the sample's first slot."""
    p, num_blocks = prompt.numel(), clean.shape[0]
    offsets = torch.arange(n)  # [n]
    block_positions = p + torch.arange(num_blocks)[:, None] * n + offsets  # [N, n]

    # AR targets: clean slot (j, o) predicts the answer token at position P + j*n + o + 1.
    answer = torch.cat([clean[j, :v] for j, v in enumerate(valid)])  # [A]: generated tokens up to EOS
    flat_pos = torch.arange(num_blocks * n)  # [Nn]: answer index of each clean slot
    has_target = flat_pos + 1 < answer.numel()  # none from EOS on, none past a block cut by the cap
    clean_labels = torch.where(has_target, answer[(flat_pos + 1).clamp(max=answer.numel() - 1)], IGNORE_INDEX)
    prompt_labels = torch.full((p,), IGNORE_INDEX, dtype=torch.long)
    prompt_labels[-1] = answer[0]
    ignored = torch.full((num_blocks, n), IGNORE_INDEX, dtype=torch.long)

    def lay_out(noisy_part: torch.Tensor, clean_part: torch.Tensor) -> torch.Tensor:
        if layout == "streams":
            return torch.cat([noisy_part.flatten(), clean_part.flatten()])  # [N, n] + [N, n] -> [2Nn]
        return torch.stack([noisy_part, clean_part], dim=1).flatten()  # [N, 2, n] -> [2Nn]

    blocks = torch.arange(num_blocks)[:, None].expand(num_blocks, n)
    streams = lay_out(torch.full_like(noisy, NOISY), torch.full_like(clean, CLEAN))
    part = {
        "input_ids": torch.cat([prompt, lay_out(noisy, clean)]),
        "position_ids": torch.cat([torch.arange(p), lay_out(block_positions, block_positions)]),
        "labels": torch.cat([prompt_labels, lay_out(ignored, clean_labels.view(num_blocks, n))]),
        "segment_ids": torch.full((p + 2 * num_blocks * n,), segment, dtype=torch.long),
        "stream": torch.cat([torch.full((p,), PROMPT), streams]),
        "block_ids": torch.cat([torch.full((p,), -1), lay_out(blocks, blocks)]),
    }

    # Consistency pairs: offsets from the first mismatch m to the last offset with a prediction.
    students, teachers = [], []
    for j, v in enumerate(valid):
        differs = (noisy[j, :v] != clean[j, :v]).nonzero().flatten()
        if differs.numel() == 0:
            continue
        last = n - 1 if v == n else v - 2
        kept = torch.arange(int(differs[0]), last + 1)  # [k]
        if layout == "streams":
            noisy_start, clean_start = p + j * n, p + (num_blocks + j) * n
        else:
            noisy_start, clean_start = p + 2 * j * n, p + (2 * j + 1) * n
        students.append(noisy_start + kept)
        teachers.append(clean_start + kept)
    empty = torch.zeros(0, dtype=torch.long)
    pairs = (torch.cat(students) if students else empty, torch.cat(teachers) if teachers else empty)
    return part, pairs
