# python -m pardec.cli.validate checkpoint=<dir> decoder=ar_greedy data=<eval set>   |
#   torchrun --nproc_per_node N -m pardec.cli.validate checkpoint=<dir> ...
"""Validate a checkpoint: decode an eval set, print a metrics table, write the results.

Examples:
    python -m pardec.cli.validate checkpoint=runs/default/export                         # AR greedy, synthetic eval set
    python -m pardec.cli.validate checkpoint=<dir> decoder=ar_sample decoder.temperature=0.5
    python -m pardec.cli.validate checkpoint=<dir> data=jsonl data.eval_files=[test.jsonl] data.train_files=[]
    torchrun --nproc_per_node 2 -m pardec.cli.validate checkpoint=<dir> data.max_eval_samples=64

Writes ``metrics.json`` (metrics + the resolved config), ``metrics.md`` (the printed table) and
``samples.jsonl`` (one record per eval sample, sorted by index) into ``output_dir`` (default
``<checkpoint>/eval/<decoder choice>/``); results written there also go into the checkpoint's model card
(``README.md``, :mod:`pardec.common.model_card`). Under torchrun each rank decodes a strided shard; only
rank 0 prints and writes. Hydra itself writes nothing (see ``pardec/recipes/validate.yaml``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pardec.common.distributed import process_group
from pardec.common.errors import CheckpointError, ConfigError, DataError
from pardec.common.model_card import EVAL_DIR, write_model_card
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import check_prompt_unknown_rate, resolve_template
from pardec.inference.checkpoint import load_for_decoding
from pardec.inference.compose import register_validate_schema
from pardec.inference.config import validate_validate_config
from pardec.inference.evaluate import evaluate
from pardec.inference.metrics import format_markdown

# The schema is the first default of pardec/recipes/validate.yaml: unknown keys fail while composing.
register_validate_schema()


@hydra.main(config_path="../recipes", config_name="validate", version_base="1.3")
def validate(cfg: DictConfig) -> None:
    try:
        cfg = validate_validate_config(cfg)
        choice = HydraConfig.get().runtime.choices.get("decoder") or cfg.decoder.name
        out_dir = Path(cfg.output_dir or Path(cfg.checkpoint) / EVAL_DIR / choice)
        check_output_dir(out_dir, cfg.output_dir is not None)
    except ConfigError as err:
        sys.exit(f"config error: {err}")
    with process_group() as ctx:  # destroyed before rank 0 writes; kept after an error (see process_group)
        try:
            model, tokenizer, auxiliary = load_for_decoding(cfg)
            resolve_template(tokenizer, cfg.data.template)  # chat without a chat template: named before data work
            eval_set = load_raw_split(cfg.data, "eval")
            check_prompt_unknown_rate(eval_set, tokenizer, cfg.data, "eval")
            result = evaluate(
                model,
                tokenizer,
                eval_set,
                cfg.decoder,
                template=cfg.data.template,
                add_bos=cfg.add_bos,
                agreement=cfg.agreement,
                reference_batch_size=cfg.reference_batch_size,
                progress=cfg.progress,
                auxiliary=auxiliary,
            )
        except (CheckpointError, DataError, ConfigError) as err:
            sys.exit(f"error: {err}")
    if not ctx.is_main:
        return
    table = format_markdown(result.metrics, title=f"{choice} on {cfg.checkpoint} ({ctx.world_size} process(es))")
    print(table)
    write_outputs(out_dir, result.metrics, result.records, cfg, ctx.world_size, table)
    print(f"wrote {out_dir}/metrics.json, metrics.md, samples.jsonl")
    if out_dir.resolve().parent == (Path(cfg.checkpoint) / EVAL_DIR).resolve():
        card = write_model_card(cfg.checkpoint)
        print(f"updated the model card {card}" if card else "the checkpoint's README.md is not pardec's: left as is")


OUTPUTS = ("metrics.json", "metrics.md", "samples.jsonl")


def check_output_dir(out_dir: Path, given: bool) -> None:
    """Before any work: ``out_dir`` (``output_dir`` when ``given``, else the default under the
    checkpoint) can be created or written, and none of :data:`OUTPUTS` in it is a directory;
    :class:`ConfigError` naming the key, the path and what is in the way."""
    key = (f"config key 'output_dir' = {out_dir}" if given
           else f"the default output directory {out_dir} (set output_dir)")
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is an existing file, not a directory; choose another output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {existing} is not writable; choose another output_dir")
    blocked = [name for name in OUTPUTS if (out_dir / name).is_dir()]
    if blocked:
        raise ConfigError(f"{key}: {out_dir / blocked[0]} is a directory where validation writes a file; "
                          f"choose another output_dir")


def write_outputs(out_dir: Path, metrics: dict, records: list[dict], cfg: DictConfig, world_size: int,
                  table: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    summary = {"metrics": metrics, "world_size": world_size, "config": config}
    (out_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "metrics.md").write_text(table)
    with open(out_dir / "samples.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    """``pardec-validate``: Hydra reads the overrides from the command line."""
    validate()


if __name__ == "__main__":
    main()
