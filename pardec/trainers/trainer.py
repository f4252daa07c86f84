"""The one training loop: a recipe's stages, each a DeepSpeed run over the method's batches.

``run_recipe`` expands ``recipe.stages`` (a stride curriculum, distillation rounds, ...) into a chain
of stage runs; stage i+1 starts from stage i's Hugging Face export, and a finished stage is skipped
on resume. ``train_stage`` is a plain DeepSpeed loop: the method supplies dataset, collation and
loss; the trainer owns optimiser, schedule, ZeRO, logging, checkpoints, preemption and export.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from pardec.common.distributed import DistInfo, all_reduce_mean, any_rank, barrier, init_distributed, main_rank_first
from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.common.model_card import command_line
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import resolve_template, tokenize_dataset
from pardec.methods.base import move_batch
from pardec.methods.registry import build_method
from pardec.models.loading import (
    check_max_positions,
    configure_flex_attention,
    load_model,
    load_tokenizer,
    resolve_attn_implementation,
    resolve_dtype,
)
from pardec.models.lora import wrap_lora
from pardec.trainers.checkpoint import (
    CHECKPOINTS,
    CONFIG_FILE,
    clear_prior_state,
    load_training_state,
    plan_resume,
    read_latest,
    read_state,
    run_on_main,
    save_training_state,
    tag_for,
)
from pardec.trainers.config import check_resume_config
from pardec.trainers.data_order import DataOrder
from pardec.trainers.deepspeed_config import build_deepspeed_config
from pardec.trainers.export import export_hf
from pardec.trainers.extension_builds import guarded_extension_builds
from pardec.trainers.fingerprint import KEY as FINGERPRINT
from pardec.trainers.fingerprint import check_fingerprint, run_fingerprint, tokenizer_fingerprint
from pardec.trainers.metrics_logger import MetricsLogger
from pardec.trainers.preemption import PREEMPTED_MARKER, PreemptionWatch
from pardec.trainers.run_lock import RunLock
from pardec.trainers.schedule import build_scheduler

log = logging.getLogger(__name__)

HF_EXPORT_DIR = "hf"
DONE_MARKER = "DONE"


@dataclass
class StageResult:
    status: str  # finished | preempted | stopped
    step: int
    export_dir: Path | None
    # Wall time of this process's optimiser steps (model loading, data preparation and export excluded).
    train_seconds: float = 0.0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def expand_stages(cfg: DictConfig) -> list[DictConfig]:
    """One config per stage. A stage is ``{name, max_steps, overrides}``; overrides are recipe keys."""
    stages = list(cfg.recipe.stages)
    if not stages:
        return [cfg]
    out = []
    for i, stage in enumerate(stages):
        unknown = set(stage) - {"name", "max_steps", "overrides"}
        if unknown:
            raise ConfigError(f"recipe.stages[{i}]: unknown keys {sorted(unknown)} "
                              "(allowed: name, max_steps, overrides)")
        stage_cfg = cfg.copy()
        OmegaConf.set_struct(stage_cfg, True)
        name = stage.get("name", f"stage{i}")
        for key, value in (stage.get("overrides") or {}).items():
            if OmegaConf.select(stage_cfg.recipe, key, default="__missing__") == "__missing__":
                raise ConfigError(f"recipe.stages[{i}] ({name}): override key 'recipe.{key}' does not exist")
            OmegaConf.update(stage_cfg.recipe, key, value, merge=True)
        if "max_steps" in stage:
            stage_cfg.trainer.max_steps = stage["max_steps"]
        stage_cfg.output_dir = str(Path(cfg.output_dir) / "stages" / f"{i:02d}-{name}")
        out.append(stage_cfg)
    return out


def run_recipe(cfg: DictConfig) -> StageResult:
    """Run the recipe's stages under an exclusive lock on ``output_dir`` (rank 0 holds it; a second
    run in the same directory refuses, naming the holder)."""
    dist_info = init_distributed(single_process_group=True)
    import deepspeed

    # DeepSpeed's comm layer wraps the group just started (left to itself it would pick its CPU
    # accelerator's default backend, not the gloo group, and see a world of one). On CPU it also
    # compiles its shared-memory op here, under the build guard.
    with guarded_extension_builds():
        deepspeed.init_distributed(dist_backend="nccl" if dist_info.device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False)
    stages = expand_stages(cfg)
    root = Path(cfg.output_dir)
    lock = run_on_main(lambda: RunLock(root).acquire(), dist_info.is_main, share_result=False)
    try:
        if cfg.trainer.resume == "never":
            note = run_on_main(lambda: clear_prior_state(root, cfg.trainer.on_existing, "trainer.resume=never"),
                               dist_info.is_main)
            if note and dist_info.is_main:
                log.warning(note)
        return _run_stages(stages, dist_info, root)
    finally:
        if lock is not None:
            lock.release()


def _done_step(stage_dir: Path) -> int | None:
    """The step a finished stage's DONE marker records (None: not finished)."""
    try:
        text = (stage_dir / DONE_MARKER).read_text()
    except OSError:
        return None
    try:
        return int(text.split()[1])
    except (IndexError, ValueError):
        return 0


def _run_stages(stages: list[DictConfig], dist_info: DistInfo, root: Path) -> StageResult:
    """The stages in order; ``root`` is the recipe's output directory (its stop file stops any stage)."""
    result = None
    previous_export: Path | None = None
    for i, stage_cfg in enumerate(stages):
        if previous_export is not None:
            stage_cfg.model.path = str(previous_export)
            stage_cfg.model.config = None
            stage_cfg.model.tokenizer = None
        stage_dir = Path(stage_cfg.output_dir)
        done = _done_step(stage_dir)
        if done is not None and stage_cfg.trainer.resume == "auto":
            what = f"stage {i} ({stage_dir})" if len(stages) > 1 else str(stage_dir)
            notes = run_on_main(partial(check_resume_config, stage_dir / CONFIG_FILE, stage_cfg, what),
                                dist_info.is_main)
            if dist_info.is_main:
                for note in notes or []:
                    log.warning(note)
            if done >= stage_cfg.trainer.max_steps:
                previous_export = stage_dir / HF_EXPORT_DIR
                if dist_info.is_main:
                    log.info("%s already finished at step %d; skipping", what, done)
                result = StageResult("finished", done, previous_export)
                continue
            later = [s.output_dir for s in stages[i + 1:] if Path(s.output_dir).exists()]
            if later:
                raise ConfigError(
                    f"{what} finished at step {done}; raising its max_steps to {stage_cfg.trainer.max_steps} "
                    f"would change the export that later stages ({', '.join(later)}) started from. Keep its max_steps, "
                    f"or start over (trainer.resume=never trainer.on_existing=archive)")
            if dist_info.is_main:
                log.warning("%s finished at step %d; continuing to the new max_steps %d", what, done,
                            stage_cfg.trainer.max_steps)
        result = train_stage(stage_cfg, dist_info, stop_dir=root)
        if result.status != "finished":
            return result
        previous_export = result.export_dir
    return result


def _param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _build_optimizer(model, cfg, on_gpu: bool):
    groups = _param_groups(model, cfg.trainer.weight_decay)
    betas = tuple(cfg.trainer.betas)
    if cfg.deepspeed.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.trainer.lr, betas=betas, eps=cfg.trainer.eps)
    return torch.optim.AdamW(groups, lr=cfg.trainer.lr, betas=betas, eps=cfg.trainer.eps, fused=on_gpu)


def _write_run_files(cfg: DictConfig, ds_config: dict, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    (run_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2))
    (run_dir / DONE_MARKER).unlink(missing_ok=True)  # this stage is running: no longer finished


def _plan(cfg: DictConfig, run_dir: Path):
    """Rank 0: where this stage starts (repairing/recovering the checkpoint directory), refusing a
    fresh start over a previous run or a resume with changed settings."""
    plan = plan_resume(run_dir, cfg.trainer.resume, cfg.trainer.on_existing)
    if plan.path is not None:
        plan.notes += check_resume_config(plan.path / CONFIG_FILE, cfg, f"{plan.path}")
        if plan.step > cfg.trainer.max_steps:
            raise ConfigError(f"config key 'trainer.max_steps' = {cfg.trainer.max_steps}, but the checkpoint to "
                              f"resume ({plan.path}) is at step {plan.step}")
    return plan


def _fingerprint(cfg: DictConfig, resume_dir: Path | None, tokenized,
                 tokenizer_print: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: the fingerprint of this stage's data and tokenizer, which every checkpoint records; a
    resume on other data refuses, naming the change, unless ``trainer.allow_data_change`` (logged)."""
    current = run_fingerprint(cfg.data, tokenized, tokenizer_print)
    if resume_dir is not None:
        for note in check_fingerprint(read_state(resume_dir) or {}, current, cfg.trainer.allow_data_change,
                                      str(resume_dir)):
            log.warning(note)
    return current


def _record_export_kind(cfg: DictConfig, method, model) -> None:
    """Write the record the export will carry (attention, logit shift, <|mask|>, ...) on the model now, so
    that in-training evaluation decodes it as what it is, and refuse (before training) an ``eval.decoder``
    that cannot decode that kind of checkpoint."""
    from pardec.inference.decoders.registry import check_checkpoint_kind

    record = CheckpointMetadata.of_model(model).updated(**method.export_metadata())
    record.write_to(model)
    if cfg.eval.every or cfg.eval.at_end:
        try:
            check_checkpoint_kind(cfg.eval.decoder, record, f"this run's export (recipe={cfg.recipe.name})")
        except CheckpointError as err:
            raise ConfigError(f"config key 'eval.decoder' = {cfg.eval.decoder!r}: {err} (or set eval.every=0 "
                              f"eval.at_end=false)") from None


def train_stage(cfg: DictConfig, dist_info: DistInfo, stop_dir: Path | None = None) -> StageResult:
    """Train one stage in ``cfg.output_dir``. Besides that directory's stop file, the one in ``stop_dir`` (the
    recipe's output directory, where ``scripts/slurm/train.sbatch`` creates it) stops the stage."""
    import deepspeed

    run_dir = Path(cfg.output_dir)
    on_gpu = dist_info.device.type == "cuda"
    dtype = resolve_dtype(cfg.model.dtype, on_gpu)
    ds_config = build_deepspeed_config(cfg, dist_info.world_size, bf16=dtype == torch.bfloat16)
    # Decide the start before writing anything: config.yaml must keep describing the checkpoints.
    plan = run_on_main(lambda: _plan(cfg, run_dir), dist_info.is_main)
    if dist_info.is_main:
        for note in plan.notes:
            log.warning(note)
        _write_run_files(cfg, ds_config, run_dir)
    barrier()
    seed_everything(cfg.trainer.seed)

    # 1. tokenizer, method and data (rank 0 first, so the datasets cache is written once)
    tokenizer = load_tokenizer(cfg.model, cfg.data)
    tokenizer_print = tokenizer_fingerprint(tokenizer)  # as loaded, before a recipe adds <|mask|>
    resolve_template(tokenizer, cfg.data.template)  # data.template=chat without a chat template: named before data work
    method = build_method(cfg.recipe, tokenizer)
    check_max_positions(cfg.model, *method.max_positions(cfg.data))  # before any data work
    attn_impl = resolve_attn_implementation(cfg.model.attn_implementation, on_gpu, method.needs_custom_mask)
    configure_flex_attention(cfg.model, attn_impl)
    with main_rank_first(dist_info.is_main):
        tokenized = tokenize_dataset(load_raw_split(cfg.data, "train"), tokenizer, cfg.data, "train",
                                     method.trains_on_responses)
    fingerprint = run_on_main(lambda: _fingerprint(cfg, plan.path, tokenized, tokenizer_print), dist_info.is_main)

    # 2. model (partitioned at load time under ZeRO-3), method-specific changes, DeepSpeed engine
    hf_ds_config = None
    if cfg.deepspeed.stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841 (must stay alive while loading)
    model = load_model(cfg.model, tokenizer, dtype, attn_impl)
    model = method.prepare_model(model)
    if cfg.model.lora.rank is not None:  # everything the method prepared frozen, a LoRA on top, merged at export
        lora = cfg.model.lora
        model = wrap_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules, cfg.trainer.seed)
    _record_export_kind(cfg, method, model)
    train_ds = method.build_train_dataset(tokenized, cfg.data, model)
    optimizer = _build_optimizer(model, cfg, on_gpu)
    # A factory: ZeRO-3 regroups the parameters, so the schedule is built on the wrapped optimizer.
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lambda opt: build_scheduler(opt, cfg.trainer), config=ds_config
    )

    # 3. resume
    state: dict[str, Any] = {"step": 0, "wandb_run_id": None}
    resume_dir = plan.path
    if resume_dir is not None:
        state = load_training_state(engine, resume_dir, dist_info.rank)
        if dist_info.is_main:
            log.info("resumed from %s at step %d", resume_dir, state["step"])
    start_step = state["step"]

    order = DataOrder(len(train_ds), cfg.trainer.micro_batch_size, cfg.trainer.grad_accum,
                      dist_info.world_size, dist_info.rank, cfg.trainer.seed)
    logger = MetricsLogger(cfg.logging, run_dir, dist_info.is_main, cfg.trainer.max_steps, start_step,
                           state.get("wandb_run_id"), OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    watch = PreemptionWatch(run_dir, stop_dir or run_dir)
    ckpt_root = run_dir / CHECKPOINTS
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)

    def checkpoint(step: int) -> None:
        saved = {"step": step, "wandb_run_id": logger.run_id, "lineage": plan.lineage, FINGERPRINT: fingerprint}
        save_training_state(engine, ckpt_root, step, saved, dist_info.rank, cfg.trainer.keep_checkpoints, config_yaml)

    eval_rows = _eval_rows(cfg) if (cfg.eval.every or cfg.eval.at_end) else None

    def evaluate(step: int) -> None:
        """Decode held-out prompts with the model in memory and log accuracy/TPF. Every rank holds
        the full model below ZeRO-3 and decodes a shard; under ZeRO-3 each forward gathers the
        partitioned weights on all ranks, so every rank decodes every prompt."""
        from pardec.inference.evaluate import evaluate_model

        decoder = {"name": cfg.eval.decoder, "max_new_tokens": cfg.eval.max_new_tokens,
                   "batch_size": cfg.eval.batch_size}
        metrics = evaluate_model(engine.module, tokenizer, eval_rows, decoder, template=cfg.data.template,
                                 agreement=False, shard=cfg.deepspeed.stage != 3)
        logger.log(step, {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        engine.train()

    def export(name: str) -> Path:
        record = CheckpointMetadata.of_model(engine.module)
        record.updated(**method.export_metadata(), base_model=cfg.model.path,
                       command=_command()).write_to(engine.module)
        return export_hf(engine.module, tokenizer, run_dir / name, cfg.deepspeed.stage, dist_info.rank)

    # 4. the loop
    step, steps_this_process = start_step, 0
    loop_start = time.perf_counter()
    window: dict[str, float] = {}
    window_steps, window_start = 0, time.perf_counter()
    engine.train()
    while step < cfg.trainer.max_steps:
        method.begin_step(step)
        for indices in order.micro_batches(step):
            batch = move_batch(method.collate([train_ds[i] for i in indices]), dist_info.device)
            loss, metrics = method.loss(engine, batch)
            engine.backward(loss)
            engine.step()
            for k, v in metrics.items():
                window[k] = window.get(k, 0.0) + v / cfg.trainer.grad_accum
        step += 1
        steps_this_process += 1
        window_steps += 1
        logger.advance()

        if step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps:
            means = all_reduce_mean({k: v / window_steps for k, v in window.items()})
            elapsed = time.perf_counter() - window_start
            record = {**means, "lr": scheduler.get_last_lr()[0], "epoch": order.epoch_of(step),
                      "steps_per_s": window_steps / elapsed}
            grad_norm = engine.get_global_grad_norm()  # None where DeepSpeed does not compute it (ZeRO-0)
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            logger.log(step, record)
            window, window_steps, window_start = {}, 0, time.perf_counter()
        if eval_rows is not None and cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.trainer.max_steps:
            evaluate(step)
        if cfg.trainer.save_every and step % cfg.trainer.save_every == 0 and step < cfg.trainer.max_steps:
            checkpoint(step)
        if cfg.trainer.export_every and step % cfg.trainer.export_every == 0 and step < cfg.trainer.max_steps:
            export(f"{HF_EXPORT_DIR}-step-{step:08d}")
        if any_rank(watch.requested()):
            checkpoint(step)
            if dist_info.is_main:
                reason = watch.reason()
                (run_dir / PREEMPTED_MARKER).write_text(f"step {step}: {reason}\n")
                watch.consume()
                log.warning("preemption (%s): checkpointed at step %d, exiting", reason, step)
            logger.close()
            watch.close()
            barrier()  # no rank exits (its launcher would stop the others) before rank 0 has finished
            return StageResult("preempted", step, None, time.perf_counter() - loop_start)
        if cfg.trainer.stop_after_steps is not None and steps_this_process >= cfg.trainer.stop_after_steps \
                and step < cfg.trainer.max_steps:
            checkpoint(step)
            logger.close()
            watch.close()
            return StageResult("stopped", step, None, time.perf_counter() - loop_start)

    # 5. the end: final checkpoint, HF export, done marker
    train_seconds = time.perf_counter() - loop_start
    resumed_here = resume_dir is not None and resume_dir.resolve() == (ckpt_root / tag_for(step)).resolve()
    if not (step == start_step and resumed_here and read_latest(ckpt_root) == tag_for(step)):
        checkpoint(step)  # (not when nothing was trained since loading the checkpoint latest names)
    export_dir = export(HF_EXPORT_DIR)
    if eval_rows is not None and cfg.eval.at_end:
        evaluate(step)
    if dist_info.is_main:
        (run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
        (run_dir / DONE_MARKER).write_text(f"step {step}\n")
    logger.close()
    watch.close()
    barrier()
    if dist_info.is_main:
        log.info("stage %s: %d steps in %.1f s of training", run_dir, step - start_step, train_seconds)
    return StageResult("finished", step, export_dir, train_seconds)


def _eval_rows(cfg: DictConfig):
    """The first ``eval.num_samples`` held-out examples, or None (logged) when there is no eval split."""
    if cfg.data.source == "files" and not cfg.data.eval_files:
        log.warning("no data.eval_files: periodic evaluation is off (set data.eval_files or eval.at_end=false)")
        return None
    rows = load_raw_split(cfg.data, "eval")
    return rows.select(range(min(cfg.eval.num_samples, len(rows))))


def _command() -> str | None:
    """``pardec-train`` with this run's command-line overrides, for the export's metadata and model card
    (None when Hydra did not start the run, e.g. a test calling :func:`run_recipe`)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return command_line("pardec-train", HydraConfig.get().overrides.task)


def configure_logging(is_main: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    if not is_main:
        os.environ["TQDM_DISABLE"] = "1"
