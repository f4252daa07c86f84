# torchrun --nproc_per_node 8 -m pardec.cli.collect_trajectories model.path=<AR checkpoint> \
#   data=<dataset> recipe.block_size=16 output_dir=<dir>
"""Collect greedy Jacobi trajectories for Jacobi Forcing, sharded over torchrun ranks and resumable.

It reuses the training config tree (``pardec/recipes/train.yaml``, recipe ``jacobi_forcing`` unless another
``recipe=`` is given, which must be ``jacobi_forcing``): the prompts are the training split of
``data.*`` tokenised exactly as training does, the model is ``model.*``, and the settings are the
recipe's top-level keys ``block_size``, ``max_new_tokens``, ``seed``, ``shard_size``,
``collect_batch_size`` and ``greedy_atol`` (``recipe.stages`` is ignored: pass round 2's values,
e.g. ``recipe.block_size=32``, with ``model.path`` = the round-1 export). Trajectories go to ``recipe.collect_dir``
(default ``${output_dir}/trajectories``); rerunning the same command resumes, skipping finished shards.
``recipe.prompt_start`` / ``recipe.num_prompts`` select a range of the training prompts, as in-run
collection does.
Train on them with ``recipe.trajectories_dir=<that directory>``.

Examples:
    python -m pardec.cli.collect_trajectories model=tiny_qwen3 data.synthetic.num_train=64 output_dir=runs/traj
    torchrun --nproc_per_node 8 -m pardec.cli.collect_trajectories model.path=<round-1 export> \\
        recipe.block_size=32 output_dir=<dir>
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from pardec.cli.train import _quiet_non_main_ranks
from pardec.common.distributed import barrier, init_distributed, main_rank_first, process_group
from pardec.common.errors import ConfigError
from pardec.data_pipelines.jacobi_trajectories import collect_trajectories, load_trajectories
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import tokenize_dataset
from pardec.methods.registry import build_method
from pardec.models.loading import (
    check_max_positions,
    load_model,
    load_tokenizer,
    resolve_attn_implementation,
    resolve_dtype,
)
from pardec.trainers.config import register_schema, validate_train_config

register_schema()
log = logging.getLogger(__name__)


def collect(cfg: DictConfig) -> Path:
    """Collect this rank's shards, wait for every rank, and (rank 0) log a summary."""
    dist_info = init_distributed(single_process_group=True)
    on_gpu = dist_info.device.type == "cuda"
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    method = build_method(cfg.recipe, tokenizer)
    check_max_positions(cfg.model, *method.max_positions(cfg.data))
    with main_rank_first(dist_info.is_main):
        tokenized = tokenize_dataset(load_raw_split(cfg.data, "train"), tokenizer, cfg.data, "train",
                                     method.trains_on_responses)
    attn = resolve_attn_implementation(cfg.model.attn_implementation, on_gpu, needs_custom_mask=False)
    model = load_model(cfg.model, tokenizer, resolve_dtype(cfg.model.dtype, on_gpu), attn).to(dist_info.device)
    prompts = method.collect_prompts(tokenized)
    directory = Path(cfg.recipe.collect_dir)
    collect_trajectories(model, prompts, directory, method.collect_settings(), dist_info.rank, dist_info.world_size)
    barrier()
    if dist_info.is_main:
        ds = load_trajectories(directory)
        tokens = sum(sum(v) for v in ds["valid_lens"])
        blocks = sum(len(v) for v in ds["valid_lens"])
        states = sum(len(b) for sample in ds["states"] for b in sample)
        log.info(
            "%d prompts, %d blocks (n=%d), %.2f states per block, vanilla Jacobi TPF %.3f, %d near-ties, in %s",
            len(ds), blocks, cfg.recipe.block_size, states / blocks, tokens / sum(ds["forwards"]), sum(ds["near_ties"]),
            directory,
        )
    return directory


@hydra.main(config_path="../recipes", config_name="train", version_base="1.3")
def collect_main(cfg: DictConfig) -> None:
    from pardec.trainers.trainer import configure_logging

    configure_logging(os.environ.get("RANK", "0") == "0")
    try:
        cfg = validate_train_config(cfg)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    if cfg.recipe.name != "jacobi_forcing":
        sys.exit(f"config error: config key 'recipe.name' = {cfg.recipe.name!r}; "
                 f"trajectories are for recipe=jacobi_forcing")
    with process_group(single_process_group=True):  # collect joins it; destroyed before exit
        directory = collect(cfg)
    if os.environ.get("RANK", "0") == "0":
        print(f"trajectories: {directory}")


def main() -> None:
    """``pardec-collect``: Hydra reads the overrides from the command line (recipe=jacobi_forcing unless given)."""
    _quiet_non_main_ranks()
    if not any(arg.startswith("recipe=") for arg in sys.argv[1:]):
        sys.argv.insert(1, "recipe=jacobi_forcing")
    collect_main()


if __name__ == "__main__":
    main()
