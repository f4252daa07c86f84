"""KV-override attention: COVER's single-forward leave-one-out verification
(docs/methods/cover.md#kv-override).

COVER re-verifies a set of *seed* positions (tokens committed at earlier steps) in the same forward
that drafts new tokens. The seeds are masked in the input, so their verifying queries cannot copy
the token under test; every other query would then lose the seeds' context, so the seed columns of
every layer's keys/values are *overridden* with the K/V the same positions had at the previous step
(computed from their tokens). A seed's own verifying query must not see that cached K/V (it encodes
the very token being verified): for it the seed's column is restored to the K/V computed from the
masked input.

The paper applies the restored column in closed form (App. B, Lemma B.1): changing one score
``s_ri`` by ``delta`` rescales the row by ``ratio = 1 + alpha * (exp(delta) - 1)`` (``alpha`` the
column's weight under the override). Exact in real arithmetic, it fails in floating point once
attention is peaked, as in pretrained models (attention sinks, retrieval heads): when the seed
column holds nearly all of the row's mass (``alpha`` -> 1) the rest of the row, ``1 - alpha``, is lost
to rounding (in fp32 ``ratio`` cancels to 0 for ``delta`` below about -17: NaN, or wrong values a
little above), ``exp(delta)`` overflows for ``delta`` > 88.7, and a column the mask hides gives
``0 * inf``. A log-space normaliser (``log Z' = logsumexp`` of the cached ``log Z`` and the seed's
two logits) removes the overflow but not the cancellation: it needs ``Z - exp(s_ri)``, the same lost
remainder. So the verifying rows' softmax is **recomputed from their scores** instead: before the
(single) softmax, each seed's verifying row gets the restored logit ``q_r . k_i * scale`` (plus the
mask) at column i, and after the value product that row's output takes ``v_i`` instead of ``v'_i`` at
column i (``o_r += w_ri * (v_i - v'_i)``: no division, rounding as in the product itself). That is the
second attention pass itself for those rows: as exact as the main pass for any scores, in fp32 and
bf16 (computed in fp32), and a column the mask hides gets weight 0 there as everywhere else.

The verifying pairs (row i - shift, column i) all lie on one diagonal of the scores, so the restored
logits and the value change are computed for every row of that diagonal (``q * h * d`` each, beside
the pass's ``q * kv * h * d``) and the seed mask picks, elementwise: no lookup of the seeds' indices,
so no host sync (a ``nonzero`` or ``any`` would stall a GPU's launches at every layer) and the forward
can be captured as a CUDA graph with the seeds and the cache in static buffers (COVER's
``cuda_graphs``). A row whose column is no seed gets its own score back and a value change of zero
(its two memories agree there): all-false seeds compute the plain attention, bit for bit.

Which row verifies seed column i follows the model's logit-shift convention: without a shift the
query at i predicts position i (row i, the diagonal); with a shift (``shift=1``, this framework's
converted models, ``CheckpointMetadata.logit_shift``) the query at i - 1 predicts position i, so the
self-leak to remove sits at row i - 1, column i.

Which queries see ``cached`` at a seed column (``KVOverrideStep.cached_for``):

- :data:`OTHERS` (the paper): the input holds the seed masked, ``cached`` holds its token's K/V;
  every query but the verifying row sees ``cached``, the verifying row this forward's (mask) K/V.
- :data:`VERIFIERS` (the mirror, for shifted models): the input holds the seed's token,
  ``cached`` holds mask-derived K/V of the seed column; only the verifying row sees ``cached``,
  every other query this forward's (token) K/V. Both are the same recomputation with the roles of
  the two memories swapped.

Use: register once (:func:`register`), switch the model to :data:`KV_OVERRIDE` (a decoder does so
in ``prepare``), and pass ``kv_override=KVOverrideStep(...)`` to the model's forward (transformers
hands extra forward kwargs to every layer's attention function). Without a step the function is
plain (eager-math) attention. The step also records each layer's K/V of this forward (the next
step's cache) and, for one layer, the corrected head-averaged attention probabilities (SDPA returns
none; COVER scores seeds from the last layer's). Grouped-query attention, any additive float mask
(block masks, padding) and a query range shorter than the keys (a prefix KV cache: the queries are
the last ``q`` keys) are supported. Inference only (no dropout).

References: COVER, Stop the Flip-Flop: Context-Preserving Verification for Fast Revocable Diffusion
Decoding, arXiv:2602.06161, §5.1 and App. B.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

KV_OVERRIDE = "pardec_kv_override"
OTHERS = "others"  # every query but the seed's verifying row sees the cached K/V (the paper)
VERIFIERS = "verifiers"  # only the seed's verifying row sees the cached K/V (the mirror)
CACHED_FOR = (OTHERS, VERIFIERS)


@dataclass
class KVOverrideStep:
    """The state of one forward, passed as ``model(..., kv_override=step)``."""

    # [b, kv] bool: seed columns, whose K/V are replaced by ``cached`` for the queries ``cached_for``
    # names. All false (or cached None): no override.
    seeds: torch.Tensor | None = None
    # Per layer index, (key, value) [b, h_kv, kv, d] (post-RoPE) for the seed columns: the previous
    # step's ``recorded`` (OTHERS), or mask-derived K/V of the seeds (VERIFIERS).
    cached: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    # OTHERS: every query but the seed's verifying row sees ``cached``; VERIFIERS: only that row.
    cached_for: str = OTHERS
    # 1 = logit shift (row i - 1 verifies column i); 0 = row i verifies column i.
    shift: int = 1
    # Keep the corrected head-averaged attention probabilities [b, q, kv] of this layer (e.g. the last).
    attention_layer: int | None = None
    # Filled during the forward: this step's (key, value) per layer, and the kept probabilities.
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    attention: torch.Tensor | None = None


def kv_override_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_override: KVOverrideStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An ``AttentionInterface`` function; returns ``(output [b, q, h, d], probabilities or None)``.

    ``query`` [b, h, q, d], ``key``/``value`` [b, h_kv, kv, d], ``attention_mask`` an additive
    float mask broadcastable to [b, h, q, kv] (or None = everything visible).
    """
    layer = module.layer_idx
    step = kv_override
    n_rep = query.shape[1] // key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_len, kv_len = query.shape[2], key.shape[2]
    offset = kv_len - q_len  # query t is key offset + t

    # 1. This forward's own K/V (the next step's cache); the override memory K', V'.
    if step is not None:
        step.recorded[layer] = (key.detach(), value.detach())
    k = repeat_kv(key, n_rep).float()  # [b, h, kv, d]
    v = repeat_kv(value, n_rep).float()  # [b, h, kv, d]
    q = query.float()  # [b, h, q, d]
    override = step is not None and step.cached is not None and step.seeds is not None
    k_all, v_all, k_row, v_row = k, v, k, v  # what every query sees; what the verifying rows see
    if override:
        if step.cached_for not in CACHED_FOR:
            raise ValueError(f"KVOverrideStep.cached_for = {step.cached_for!r}; expected one of {CACHED_FOR}")
        cached_k, cached_v = step.cached[layer]
        seed_cols = step.seeds[:, None, :, None]  # [b, 1, kv, 1]
        k_swap = torch.where(seed_cols, repeat_kv(cached_k, n_rep).float(), k)  # [b, h, kv, d]
        v_swap = torch.where(seed_cols, repeat_kv(cached_v, n_rep).float(), v)  # [b, h, kv, d]
        if step.cached_for == OTHERS:
            k_all, v_all = k_swap, v_swap
        else:
            k_row, v_row = k_swap, v_swap

    # 2. Scores of what every query sees.
    scores = torch.matmul(q, k_all.transpose(-1, -2)) * scale  # [b, h, q, kv]
    if attention_mask is not None:
        scores = scores + attention_mask.float()

    # 3. Each seed's verifying row r = i - shift - offset gets column i's logit from k_row (plus the mask) before the
    # softmax. The pairs (r, r + diagonal) lie on one diagonal of the [q, kv] scores: every row's is computed and a
    # seed mask picks (elementwise, no lookup of the seeds' indices: no host sync, capturable in a CUDA graph).
    diagonal = step.shift + offset if override else 0
    rows = q_len - step.shift if override else 0  # rows with a column at the diagonal
    if override and rows > 0:
        verified = step.seeds[:, None, diagonal:]  # [b, 1, rows]: the column of row r is a seed
        restored = (q[:, :, :rows] * k_row[:, :, diagonal:]).sum(-1) * scale  # [b, h, rows]
        if attention_mask is not None:
            restored = restored + attention_mask.float().expand_as(scores).diagonal(diagonal, -2, -1)  # [b, h, rows]
        on_diagonal = scores.diagonal(diagonal, -2, -1)  # [b, h, rows], a view
        on_diagonal.copy_(torch.where(verified, restored, on_diagonal))

    # 4. Softmax and values; the verifying rows' column takes v_row's value instead of v_all's (the two differ
    # only at the seed columns, so the correction is zero elsewhere).
    weights = torch.softmax(scores, dim=-1)  # [b, h, q, kv]
    out = torch.matmul(weights, v_all)  # [b, h, q, d]
    if override and rows > 0:
        seed_weight = weights.diagonal(diagonal, -2, -1).unsqueeze(-1)  # [b, h, rows, 1]
        out[:, :, :rows] += seed_weight * (v_row[:, :, diagonal:] - v_all[:, :, diagonal:])  # [b, h, rows, d]

    # 5. Keep one layer's head-averaged probabilities (COVER's seed scoring).
    if step is not None and step.attention_layer == layer:
        step.attention = weights.mean(dim=1)  # [b, q, kv]
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def register() -> None:
    """Make :data:`KV_OVERRIDE` a valid ``attn_implementation`` (idempotent)."""
    AttentionInterface.register(KV_OVERRIDE, kv_override_attention)
