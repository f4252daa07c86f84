"""``pardec/benchmarks/flex_kernels.py`` without a GPU: the fastest choice is picked among the recipe's timed
kernel options at the asked length (not the reference rows, a failed choice, a compile mode, a
causal-mask row or another BlockMask tile size),
and every row kind renders."""

from __future__ import annotations

from pardec.benchmarks.flex_kernels import best_choice, markdown

ROWS = [
    {"recipe": "J", "seq_len": 8192, "kernel": "sdpa causal", "fwd_ms": 1.0, "bwd_ms": 2.0, "total_ms": 3.0,
     "vs_sdpa_causal": 1.0},
    {"recipe": "J", "seq_len": 8192, "kernel": "BlockMask build (per step)", "total_ms": 0.4},
    {"recipe": "J", "seq_len": 8192, "kernel": "flex jacobi, default", "fwd_ms": 1.0, "bwd_ms": 1.0, "total_ms": 2.0,
     "kernel_options": {}, "compile_mode": None, "max_diff_vs_default": 0.0, "vs_sdpa_causal": 0.67},
    {"recipe": "J", "seq_len": 8192, "kernel": "flex jacobi, TMA", "error": "InductorError: no"},
    {"recipe": "J", "seq_len": 16384, "kernel": "flex jacobi, default", "fwd_ms": 4.0, "bwd_ms": 6.0,
     "total_ms": 10.0, "kernel_options": {}, "compile_mode": None, "max_diff_vs_default": 0.0},
    {"recipe": "J", "seq_len": 16384, "kernel": "flex jacobi, fwd 64x64", "fwd_ms": 3.0, "bwd_ms": 6.0,
     "total_ms": 9.0, "kernel_options": {"BLOCK_M": 64, "BLOCK_N": 64}, "compile_mode": None,
     "max_diff_vs_default": 0.01},
    {"recipe": "J", "seq_len": 16384, "kernel": "flex jacobi, max-autotune", "fwd_ms": 2.0, "bwd_ms": 5.0,
     "total_ms": 7.0, "kernel_options": {}, "compile_mode": "max-autotune-no-cudagraphs", "max_diff_vs_default": 0.01},
    {"recipe": "J", "seq_len": 16384, "kernel": "sdpa causal", "fwd_ms": 1.0, "bwd_ms": 1.0, "total_ms": 2.0},
    {"recipe": "J", "seq_len": 16384, "kernel": "flex causal, TMA", "fwd_ms": 1.0, "bwd_ms": 1.0, "total_ms": 2.0,
     "mask": "causal", "kernel_options": {"USE_TMA": True}, "compile_mode": None, "block_size": 128},
    {"recipe": "J", "seq_len": 16384, "kernel": "flex jacobi, TMA, 64-token BlockMask", "fwd_ms": 1.0,
     "bwd_ms": 1.0, "total_ms": 2.0, "mask": "jacobi", "kernel_options": {"USE_TMA": True}, "compile_mode": None,
     "block_size": 64},
]


def test_best_choice_is_the_fastest_kernel_options_at_that_length():
    best = best_choice(ROWS, "J", 16384)
    assert best == {"name": "flex jacobi, fwd 64x64", "kernel_options": {"BLOCK_M": 64, "BLOCK_N": 64},
                    "compile_mode": None, "repeat_kv": False, "total_ms": 9.0}
    assert best_choice(ROWS, "J", 8192)["name"] == "flex jacobi, default"


def test_markdown_renders_every_row_kind():
    lines = markdown(ROWS).splitlines()
    assert len(lines) == 2 + len(ROWS)
    assert "| J | 8192 | flex jacobi, TMA | InductorError: no |" in lines[5]
    assert lines[3].endswith("| 0.400 |  |  |  |")  # the mask build: once per step, not per layer
    assert "| 1.000 | 1.000 | 2.000 | 48.0 | 0.67 | 0 |" in lines[4]


def test_the_saved_autotuned_choice_is_the_one_the_framework_names():
    """``benchmarks/results/flex_kernels_best.json`` (what docs/results/gpu.md's mask_backends command reads) and
    ``pardec.models.flex_attention.AUTOTUNED_HOPPER_HEAD_DIM_64`` were written apart: they must not drift."""
    import json
    from pathlib import Path

    from pardec.models.flex_attention import AUTOTUNED_HOPPER_HEAD_DIM_64

    saved = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/flex_kernels_best.json").read_text())
    assert saved == {"name": "autotuned", "kernel_options": AUTOTUNED_HOPPER_HEAD_DIM_64, "compile_mode": None}
