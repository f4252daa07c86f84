"""Rank-0 metrics: JSONL file, wandb (offline by default; ``logging=none`` turns it off) and tqdm."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


class MetricsLogger:
    def __init__(self, log_cfg, run_dir: Path, is_main: bool, total_steps: int, start_step: int,
                 run_id: str | None, config: dict[str, Any]):
        self.is_main = is_main
        self.wandb_run = None
        self.run_id = run_id
        self.bar = None
        if not is_main:
            return
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
