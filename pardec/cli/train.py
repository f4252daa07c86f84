# torchrun --nproc_per_node 8 -m pardec.cli.train experiment=<x> model.path=<local HF checkpoint> \
#   data=<dataset> deepspeed=zero3
"""Train with a recipe (Hydra config tree in ``pardec/recipes/``); one process or many under torchrun.

Examples:
    python -m pardec.cli.train experiment=default_base                      # the embedded default (CPU)
    torchrun --nproc_per_node 2 -m pardec.cli.train experiment=default_base deepspeed=zero2
    python -m pardec.cli.train experiment=default_base --cfg job             # print the composed config

Launch with torchrun, never the ``deepspeed`` launcher (its ``--local_rank`` argument breaks Hydra).
Only rank 0 writes Hydra's files in the run directory (``output_dir``).
Exit status: 0 when training finished (or stopped at ``trainer.stop_after_steps``), ``PREEMPTED_EXIT_CODE``
(75, ``pardec/trainers/preemption.py``) when a signal or a stop file made it checkpoint and stop: run it again
to resume.
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pardec.common.errors import ConfigError, PardecError
from pardec.trainers.config import register_schema, validate_train_config
from pardec.trainers.preemption import PREEMPTED_EXIT_CODE

register_schema()


def _quiet_non_main_ranks() -> None:
    if os.environ.get("RANK", "0") != "0":
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra/hydra_logging=disabled"]


@hydra.main(config_path="../recipes", config_name="train", version_base="1.3")
def train(cfg: DictConfig) -> None:
    from pardec.common.distributed import process_group
    from pardec.trainers.trainer import configure_logging, run_recipe

    configure_logging(os.environ.get("RANK", "0") == "0")
    try:
        cfg = validate_train_config(cfg, HydraConfig.get().overrides.task)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    with process_group(single_process_group=True):  # run_recipe joins it; destroyed before exit
        try:
            result = run_recipe(cfg)
        except PardecError as err:  # a refusal (existing run, lock, changed settings) or a bad checkpoint
            sys.exit(f"error: {err}")
    if os.environ.get("RANK", "0") == "0":
        where = f", Hugging Face export: {result.export_dir}" if result.export_dir else ""
        print(f"training {result.status} at step {result.step} ({result.train_seconds:.0f} s of training steps){where}")
    if result.status == "preempted":
        sys.exit(PREEMPTED_EXIT_CODE)


def refuse_file_output_dir(argv: list[str]) -> None:
    """Exit naming the path when an ``output_dir=`` override names an existing file: Hydra creates the
    run directory (``hydra.run.dir=${output_dir}``) before any pardec code runs, and would fail inside
    ``mkdir`` with a traceback."""
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and key == "output_dir" and os.path.exists(value) and not os.path.isdir(value):
            sys.exit(f"config error: output_dir={value} is an existing file, not a directory: give a run directory")


def main() -> None:
    """``pardec-train``: Hydra reads the overrides from the command line."""
    refuse_file_output_dir(sys.argv[1:])
    _quiet_non_main_ranks()
    train()


if __name__ == "__main__":
    main()
