"""Jacobi Forcing training masks over packed ``[prompt][k_0][c_0][k_1][c_1]...`` samples
(docs/methods/jacobi_forcing.md#masks).

k_j is block j's noisy state (a point of its Jacobi trajectory), c_j its fixed point (clean); both
copies take positions ``P + j*n + o`` (P = prompt length, n = block size, o = offset in the block).
Every token carries ``[b, s]`` metadata tensors (built by ``pardec.data_pipelines.jacobi_batch``):

* ``segment_ids``: packed sample id inside the row, ``-1`` for padding;
* ``stream``: ``PROMPT`` (0), ``NOISY`` (1, the k_j copies) or ``CLEAN`` (2, the c_j copies);
* ``block_ids``: block index j, ``-1`` on prompt tokens (and padding);
* ``position_ids``: the token's position inside its sample (the model's ``position_ids``);
* ``window_ids`` (NC-IC only): ``j // w`` for the noise schedule's window size w, ``-1`` on the
  prompt.

Comparisons use metadata, never buffer indices, so the predicates do not depend on where a sample
sits in the packed row. Padding attends only to itself (finite softmax rows, outputs unused).
"""

from __future__ import annotations

import torch

from pardec.masks.core import MaskMod, within_sample

PROMPT = 0
NOISY = 1
CLEAN = 2


def jacobi_nc_mask(
    segment_ids: torch.Tensor,
    stream: torch.Tensor,
    block_ids: torch.Tensor,
    position_ids: torch.Tensor,
) -> MaskMod:
    """Noise-conditioned ("NC") mask, paper Fig. 2b (q = query, kv = key, p = position, B = block).

    Inside one sample (same ``segment_ids >= 0``):

    * prompt -> prompt: ``p(kv) <= p(q)`` (causal);
    * noisy q in block j -> the prompt, noisy blocks ``B(kv) < j``, and its own noisy block
      causally (``B(kv) == j`` and ``p(kv) <= p(q)``);
    * clean q in block j -> the prompt, clean blocks ``B(kv) < j``, and its own clean block
      causally;
    * noisy never sees clean, clean never sees noisy, the prompt sees neither.

    Each stream is therefore exactly a causal sequence: noisy block j's logits are those of a plain
    causal forward over ``[prompt, k_0, ..., k_j]`` (the student of Eq. 8, conditioned on the noisy
    earlier blocks) and clean block j's those of ``[prompt, c_0, ..., c_j]`` (the teacher and the AR
    stream). One sample, prompt length P = 2, block size n = 2, two blocks; ``nX`` / ``cX`` is the
    noisy / clean copy of position X::

        q\\kv   p0 p1   n2 n3   c2 c3   n4 n5   c4 c5
        p0      x  .    .  .    .  .    .  .    .  .
        p1      x  x    .  .    .  .    .  .    .  .
        n2      x  x    x  .    .  .    .  .    .  .
        n3      x  x    x  x    .  .    .  .    .  .
        c2      x  x    .  .    x  .    .  .    .  .
        c3      x  x    .  .    x  x    .  .    .  .
        n4      x  x    x  x    .  .    x  .    .  .
        n5      x  x    x  x    .  .    x  x    .  .
        c4      x  x    .  .    x  x    .  .    x  .
        c5      x  x    .  .    x  x    .  .    x  x
    """

    def inside_sample(b, h, q_idx, kv_idx):
        stream_q, stream_kv = stream[b, q_idx], stream[b, kv_idx]
        block_q, block_kv = block_ids[b, q_idx], block_ids[b, kv_idx]
        causal = position_ids[b, kv_idx] <= position_ids[b, q_idx]
        prompt_self = (stream_q == PROMPT) & (stream_kv == PROMPT) & causal
        block_q_sees_prompt = (stream_q != PROMPT) & (stream_kv == PROMPT)
        same_stream = (stream_q != PROMPT) & (stream_kv == stream_q)
        earlier_or_causal = (block_kv < block_q) | ((block_kv == block_q) & causal)
        allowed = prompt_self | block_q_sees_prompt | (same_stream & earlier_or_causal)
        return allowed

    return within_sample(segment_ids, inside_sample)


def jacobi_nc_ic_mask(
    segment_ids: torch.Tensor,
    stream: torch.Tensor,
    block_ids: torch.Tensor,
    position_ids: torch.Tensor,
    window_ids: torch.Tensor,
) -> MaskMod:
    """Noise-conditioned mask with intra-window clean context ("NC-IC"), the paper's ablation
    (§4.3, Table 5).

    The paper: "condition all blocks within a window on a clean context ... for every query, it
    sees blocks from all preceding windows as of Fig. 2a [noisy blocks conditioned on clean earlier
    blocks, CLLM-style], and all blocks within its own window as of Fig. 2b [NC]". With windows of
    w blocks (the noise schedule's window, W(j) = j // w), inside one sample:

    * prompt -> prompt: causal;
    * noisy q in block j -> the prompt, the *clean* blocks of preceding windows
      (``W(kv) < W(q)``), the noisy blocks of its own window before it (``W(kv) == W(q)``,
      ``B(kv) < j``), and its own noisy block causally;
    * clean q: exactly as in NC (prompt, clean blocks < j, own block causally).

    So noisy block j's logits equal a causal forward over
    ``[prompt, c_0, ..., c_{s-1}, k_s, ..., k_j]`` with s = W(j) * w the first block of its window.
    With w = 1 this is the CLLM consistency mask (every noisy block on a clean prefix); with
    w >= the number of blocks it is NC. One sample, P = 1, n = 2, three blocks, w = 2 (blocks 0
    and 1 form window 0, block 2 window 1)::

        q\\kv   p0   n1 n2   c1 c2   n3 n4   c3 c4   n5 n6   c5 c6
        p0      x    .  .    .  .    .  .    .  .    .  .    .  .
        n1      x    x  .    .  .    .  .    .  .    .  .    .  .
        n2      x    x  x    .  .    .  .    .  .    .  .    .  .
        c1      x    .  .    x  .    .  .    .  .    .  .    .  .
        c2      x    .  .    x  x    .  .    .  .    .  .    .  .
        n3      x    x  x    .  .    x  .    .  .    .  .    .  .
        n4      x    x  x    .  .    x  x    .  .    .  .    .  .
        c3      x    .  .    x  x    .  .    x  .    .  .    .  .
        c4      x    .  .    x  x    .  .    x  x    .  .    .  .
        n5      x    .  .    x  x    .  .    x  x    x  .    .  .
        n6      x    .  .    x  x    .  .    x  x    x  x    .  .
        c5      x    .  .    x  x    .  .    x  x    .  .    x  .
        c6      x    .  .    x  x    .  .    x  x    .  .    x  x
    """

    def inside_sample(b, h, q_idx, kv_idx):
        stream_q, stream_kv = stream[b, q_idx], stream[b, kv_idx]
        block_q, block_kv = block_ids[b, q_idx], block_ids[b, kv_idx]
        window_q, window_kv = window_ids[b, q_idx], window_ids[b, kv_idx]
        causal = position_ids[b, kv_idx] <= position_ids[b, q_idx]
        earlier_or_causal = (block_kv < block_q) | ((block_kv == block_q) & causal)
        prompt_self = (stream_q == PROMPT) & (stream_kv == PROMPT) & causal
        block_q_sees_prompt = (stream_q != PROMPT) & (stream_kv == PROMPT)
        clean_q = (stream_q == CLEAN) & (stream_kv == CLEAN) & earlier_or_causal
        noisy_q = stream_q == NOISY
        noisy_own_window = noisy_q & (stream_kv == NOISY) & (window_kv == window_q) & earlier_or_causal
        noisy_clean_past = noisy_q & (stream_kv == CLEAN) & (window_kv < window_q)
        allowed = prompt_self | block_q_sees_prompt | clean_q | noisy_own_window | noisy_clean_past
        return allowed

    return within_sample(segment_ids, inside_sample)
