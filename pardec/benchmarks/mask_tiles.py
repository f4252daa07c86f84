# python -m pardec.benchmarks.mask_tiles --lengths 8192 16384
"""FlexAttention work of each recipe's packed row, counted in BlockMask tiles (CPU).

FlexAttention skips empty 128 x 128 tiles, runs full tiles without the mask predicate, and evaluates
the predicate on every element of a partial tile. The rows are those of
``pardec/benchmarks/mask_backends.py`` (same builders, same seed); for each, the share of tiles that are
partial and full, and the tiles computed (partial + full) against plain causal attention over the
same row. ``Jacobi NC n=32, streams layout`` is the same sample packed with ``layout="streams"``
([prompt | every noisy block | every clean block], ``recipe.layout=streams``): the mask reads only
per-token metadata and position ids, so this is the same attention, laid out for tiles. Writes
``benchmarks/results/mask_tiles.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

from pardec.benchmarks.common import RESULTS
from pardec.benchmarks.mask_backends import idlm_batch, jacobi_batch
from pardec.masks.core import causal

TILE = 128


def tile_counts(mask_mod, length: int) -> tuple[int, int]:
    block_mask = create_block_mask(mask_mod, 1, None, length, length, device="cpu", BLOCK_SIZE=TILE)
    full = block_mask.full_kv_num_blocks
    return int(block_mask.kv_num_blocks.sum()), int(full.sum()) if full is not None else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--out", default=str(RESULTS / "mask_tiles"))
    args = p.parse_args()
    rows = []
    for length in args.lengths:
        g = torch.Generator().manual_seed(0)
        idlm = idlm_batch(length, g)["attention"]
        state = g.get_state()
        jacobi = jacobi_batch(length, g)["attention"]
        g.set_state(state)  # the same sample in both layouts
        streams = jacobi_batch(length, g, layout="streams")["attention"]
        layouts = {"causal (the floor)": causal, "I-DLM stride 4": idlm.mask_mod(),
                   "Jacobi NC n=32": jacobi.mask_mod(), "Jacobi NC n=32, streams layout": streams.mask_mod()}
        causal_tiles = sum(tile_counts(causal, length))
        tiles = (length // TILE) ** 2
        for name, mask_mod in layouts.items():
            partial, full = tile_counts(mask_mod, length)
            rows.append({"layout": name, "tokens": length, "partial": partial / tiles, "full": full / tiles,
                         "computed_vs_causal": (partial + full) / causal_tiles})
            print(json.dumps(rows[-1]), flush=True)
    md = "\n".join(
        ["| layout | tokens | partial tiles | full tiles | tiles computed / causal |", "|---|---|---|---|---|"]
        + [f"| {r['layout']} | {r['tokens']} | {r['partial']:.1%} | {r['full']:.1%} | {r['computed_vs_causal']:.2f} |"
           for r in rows])
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(
        f"Command: python -m pardec.benchmarks.mask_tiles --lengths {' '.join(map(str, args.lengths))}\n"
        f"BlockMask tiles of {TILE} x {TILE}, torch {torch.__version__}.\n\n{md}\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
