"""Hugging Face export (``save_pretrained`` + tokenizer + model card), gathering ZeRO-3 partitions first.

Written to ``<dir>.tmp`` by rank 0 and renamed, so a reader never sees a half-written export. A
ZeRO-3 model's local parameters are empty placeholders; exporting them without gathering gives the
classic empty-tensor ``model.safetensors``, so the full parameters are gathered and checked.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

from pardec.common.distributed import barrier
from pardec.common.model_card import write_model_card


def _gathered(module, zero_stage: int):
    if zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


def full_state_dict(module, zero_stage: int, rank: int) -> dict[str, torch.Tensor] | None:
    """Full (gathered) state dict on rank 0, None elsewhere; tied tensors stay shared."""
    state = None
    with _gathered(module, zero_stage):
        if rank == 0:
            clones: dict[int, torch.Tensor] = {}
            state = {}
            for name, tensor in module.state_dict().items():
                key = tensor.data_ptr()
                if key not in clones:
                    clones[key] = tensor.detach().to("cpu", copy=True)
                state[name] = clones[key]
            empty = [n for n, t in state.items() if t.numel() == 0]
            if empty:
                raise RuntimeError(f"export would write empty tensors (ZeRO-3 not gathered?): {empty[:3]}")
    return state


def export_hf(module, tokenizer, out_dir: Path, zero_stage: int, rank: int) -> Path:
    state = full_state_dict(module, zero_stage, rank)
    if rank == 0:
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_model_card(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    barrier()
    return out_dir
