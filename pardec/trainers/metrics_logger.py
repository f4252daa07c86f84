"""Rank-0 metrics: JSONL file, wandb (offline by default; ``logging=none`` turns it off) and tqdm."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

log = logging.getLogger(__name__)
DROPPED = "metrics.dropped.jsonl"


def _drop_records_after(path: Path, step: int) -> None:
    """A run (re)starting at ``step`` will log steps after it again: move the records a previous
    attempt logged past its last checkpoint (and any torn last line) to ``metrics.dropped.jsonl``,
    marked with the step resumed from, so ``metrics.jsonl`` holds each step once."""
    if not path.is_file():
        return
    keep, dropped = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            stale = int(record["step"]) > step
        except (ValueError, KeyError, TypeError):
            record, stale = {"unparsable": line}, True
        if stale:
            dropped.append(json.dumps({**record, "dropped_on_resume_from_step": step}))
        else:
            keep.append(line)
    if not dropped:
        return
    with open(path.with_name(DROPPED), "a") as f:
        f.write("\n".join(dropped) + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    log.warning("%s: %d records logged after step %d by an earlier attempt were moved to %s (this run logs "
                "those steps again)", path, len(dropped), step, DROPPED)


class MetricsLogger:
    def __init__(self, log_cfg, run_dir: Path, is_main: bool, total_steps: int, start_step: int,
                 run_id: str | None, config: dict[str, Any]):
        self.is_main = is_main
        self.wandb_run = None
        self.run_id = run_id
        self.bar = None
        if not is_main:
            return
        _drop_records_after(run_dir / "metrics.jsonl", start_step)
        self.jsonl = open(run_dir / "metrics.jsonl", "a")
        if log_cfg.progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        if log_cfg.backend == "wandb":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = wandb.init(
                project=log_cfg.project,
                entity=log_cfg.entity,
                name=log_cfg.run_name,
                id=run_id,
                resume="allow",
                mode=log_cfg.wandb_mode,
                dir=str(run_dir),
                config=config,
            )
            self.run_id = self.wandb_run.id

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        record = {"step": step, **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.bar is not None:
            shown = {k: f"{v:.4g}" for k, v in metrics.items() if isinstance(v, float) and k.startswith(("loss", "lr"))}
            self.bar.set_postfix(shown, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
