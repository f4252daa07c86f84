"""Jacobi Forcing recipe: progressive consistency distillation on the model's own Jacobi trajectories.

Per stage (docs/methods/jacobi_forcing.md):

1. ``build_train_dataset`` collects greedy Jacobi trajectories of the training prompts with the
   model the stage starts from (``pardec.data_pipelines.jacobi_trajectories``; sharded over the torchrun
   ranks, resumable), or loads trajectories collected beforehand by
   ``pardec/cli/collect_trajectories.py`` (``recipe.trajectories_dir``; the dataset's own responses
   are then not used at all). Each sample's noisy blocks are then chosen by the noise schedule
   (``pardec.data_pipelines.jacobi_noise``);
2. ``collate`` packs ``[prompt][k_0][c_0][k_1][c_1]...`` rows (or, with ``recipe.layout=streams``,
   the same attention laid out ``[prompt][k_0 ... k_{N-1}][c_0 ... c_{N-1}]`` for FlexAttention's
   tiles) with the NC (or NC-IC) mask (``pardec.data_pipelines.jacobi_batch``, ``pardec.masks.jacobi``);
3. ``loss``: one forward, L = L_pc + w * L_AR (``pardec.losses.jacobi``).

Progressive distillation is the stage list of ``pardec/recipes/recipe/jacobi_forcing.yaml``: round 1
(n = 16, w = 16) on trajectories of the base model, round 2 (n = 32, w = 8) on trajectories
re-collected with the round-1 export (the trainer starts stage i + 1 from stage i's export and
passes that model to ``build_train_dataset``).

Where collected trajectories go: the trainer gives the method no output directory, so the
recipe key ``collect_dir`` names it; the recipe YAML sets it to ``${output_dir}/trajectories``,
an interpolation that resolves against each stage's own ``output_dir`` (``expand_stages`` sets it
per stage), so every round collects into its stage directory and a resumed stage skips the
finished shards. In-trainer collection needs the full parameters on every rank (ZeRO stage < 3);
under ZeRO-3, or for large prompt sets (ranks wait at a barrier while the others collect),
collect beforehand with the script and set ``trajectories_dir``.

``micro_batch_size`` counts samples (prompts); each micro-batch is packed at collate time into
rows of ``data.pack_length`` slots (P + 2 * N * n per sample); null = the longest sample.

References: Fast and Accurate Causal Parallel Decoding using Jacobi Forcing, arXiv:2512.14681.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from pardec.common.config_fields import ranged
from pardec.common.distributed import barrier
from pardec.common.errors import ConfigError, DataError
from pardec.data_pipelines.jacobi_batch import JacobiLayout, JacobiMask, build_jacobi_batch, sample_length
from pardec.data_pipelines.jacobi_noise import NoiseSchedule, WindowPhase, select_noisy_blocks
from pardec.data_pipelines.jacobi_trajectories import (
    CollectSettings,
    collect_trajectories,
    load_trajectories,
    read_meta,
)
from pardec.data_pipelines.packing import PadTo
from pardec.data_pipelines.tokenize import stop_token_ids
from pardec.losses.jacobi import jacobi_forcing_loss
from pardec.methods.base import Method, forward_logits
from pardec.methods.recipe_config import RecipeConfig


@dataclass
class JacobiForcingConfig(RecipeConfig):
    name: str = "jacobi_forcing"
    # Jacobi block size n (trajectory collection and training).
    block_size: int = ranged(16, ge=1)
    # Noise-schedule window w (in blocks); also NC-IC's window.
    window: int = ranged(16, ge=1)
    schedule: NoiseSchedule = NoiseSchedule.progressive
    # zero (windows start at block 0, docs/methods/jacobi_forcing.md#noise-schedule) | random (per-sample shift;
    # see pardec.data_pipelines.jacobi_noise)
    window_phase: WindowPhase = WindowPhase.zero
    # nc (noise-conditioned, the paper's choice) | nc_ic (intra-window clean context, ablation)
    mask: JacobiMask = JacobiMask.nc
    # interleaved ([prompt][k_0][c_0][k_1][c_1]..., docs/methods/jacobi_forcing.md#packing) | streams (every noisy
    # block, then every clean block: the same attention, about half the FlexAttention tiles;
    # pardec.data_pipelines.jacobi_batch)
    layout: JacobiLayout = JacobiLayout.interleaved
    # w in L = L_pc + w * L_AR.
    ar_weight: float = ranged(10.0, ge=0)
    # Trajectory length cap (whole blocks are generated: at most ceil(max_new_tokens / n) blocks).
    max_new_tokens: int = ranged(128, ge=1)
    # Seeds the drafts' random init and the random schedule (per prompt: (seed, prompt index)).
    seed: int = ranged(0, ge=0)
    # Prompts per trajectory shard file (the unit of resume).
    shard_size: int = ranged(64, ge=1)
    # Prompts collected together, left-padded, in lockstep: the same rows as one at a time, up to kernel
    # rounding (docs/methods/jacobi_forcing.md#trajectory-collection); for GPUs, where small forwards are launch-bound.
    collect_batch_size: int = ranged(1, ge=1)
    # Logit gap tolerated when checking the fixed points against AR greedy; null = 0 in float32,
    # 0.5 in 16-bit (see pardec.data_pipelines.jacobi_trajectories).
    greedy_atol: Optional[float] = ranged(None, ge=0)
    # Pre-collected trajectories (pardec/cli/collect_trajectories.py); null = collect in this stage.
    trajectories_dir: Optional[str] = None
    # Where this stage collects (resumable shards); the recipe YAML sets ${output_dir}/trajectories.
    collect_dir: Optional[str] = None
    # The training prompts this stage collects from: rows [prompt_start, prompt_start + num_prompts)
    # of the training split (null = to its end). Per-stage values give each round fresh prompts.
    prompt_start: int = ranged(0, ge=0)
    num_prompts: Optional[int] = ranged(None, ge=1)


def _examples(row, block_size: int, window: int, schedule: str, phase: str, seed: int) -> dict:
    """One training example: the prompt, the schedule's noisy state and the fixed point per block."""
    noisy = select_noisy_blocks(
        row["states"], row["fixed_points"], row["valid_lens"], window, schedule, (seed, row["index"]), phase
    )
    return {
        "prompt_ids": row["prompt_ids"],
        "noisy_blocks": noisy,
        "clean_blocks": row["fixed_points"],
        "valid_lens": row["valid_lens"],
        "length": sample_length(len(row["prompt_ids"]), len(row["fixed_points"]), block_size),
    }


class JacobiForcingMethod(Method):
    name = "jacobi_forcing"
    needs_custom_mask = True

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        if cfg.trajectories_dir is not None and (cfg.prompt_start or cfg.num_prompts is not None):
            raise ConfigError(
                "'recipe.prompt_start' / 'recipe.num_prompts' select the prompts to collect from; with "
                "'recipe.trajectories_dir' nothing is collected: set them on pardec/cli/collect_trajectories.py instead"
            )
        if cfg.trajectories_dir is None and cfg.collect_dir is None:
            raise ConfigError("set 'recipe.trajectories_dir' (pre-collected) or 'recipe.collect_dir' (collect here)")
        self.pack_length: int | None = None
        self.pad_to = PadTo.pack_length

    def collect_settings(self) -> CollectSettings:
        return CollectSettings(
            block_size=self.cfg.block_size,
            max_new_tokens=self.cfg.max_new_tokens,
            eos_token_ids=tuple(sorted(stop_token_ids(self.tokenizer))),  # EOS and the chat end of turn
            pad_token_id=self.tokenizer.pad_token_id,
            seed=self.cfg.seed,
            shard_size=self.cfg.shard_size,
            greedy_atol=self.cfg.greedy_atol,
            batch_size=self.cfg.collect_batch_size,
        )

    def max_positions(self, data_cfg) -> tuple[int, str]:
        """A prompt of at most ``data.max_length - 1`` tokens (a tokenised sample keeps at least its
        EOS after the prompt), then ``ceil(max_new_tokens / n)`` whole blocks of n positions (the
        noisy and clean copies of a block share them), in collection and in training alike."""
        n = self.cfg.block_size
        generated = -(-self.cfg.max_new_tokens // n) * n
        return data_cfg.max_length - 1 + generated, (
            f"data.max_length={data_cfg.max_length} (prompts) + recipe.max_new_tokens={self.cfg.max_new_tokens} "
            f"(in whole blocks of recipe.block_size={n}: {generated})"
        )

    @property
    def trains_on_responses(self) -> bool:
        return False  # prompts only: the targets are the model's own trajectories

    def collect_prompts(self, tokenized) -> list[list[int]]:
        """The prompt ids to collect from: tokenised training rows [prompt_start, prompt_start + num_prompts)."""
        prompts = [ids[:p] for ids, p in zip(tokenized["input_ids"], tokenized["prompt_len"])]
        stop = None if self.cfg.num_prompts is None else self.cfg.prompt_start + self.cfg.num_prompts
        if stop is not None and stop > len(prompts):
            raise DataError(
                f"recipe.prompt_start={self.cfg.prompt_start} + recipe.num_prompts={self.cfg.num_prompts} > "
                f"{len(prompts)} training prompts (raise data.max_train_samples or lower recipe.num_prompts)"
            )
        prompts = prompts[self.cfg.prompt_start : stop]
        if not prompts:
            raise DataError(
                f"recipe.prompt_start={self.cfg.prompt_start} leaves no prompt of the {len(tokenized)} training prompts"
            )
        return prompts

    def build_train_dataset(self, tokenized, data_cfg, model=None):
        directory = Path(self.cfg.trajectories_dir) if self.cfg.trajectories_dir else self._collect(tokenized, model)
        meta = read_meta(directory)
        if meta["block_size"] != self.cfg.block_size:
            raise DataError(
                f"{directory}: trajectories were collected with block_size={meta['block_size']} but "
                f"recipe.block_size={self.cfg.block_size}"
            )
        trajectories = load_trajectories(directory)
        examples = trajectories.map(
            _examples,
            fn_kwargs={"block_size": self.cfg.block_size, "window": self.cfg.window,
                       "schedule": self.cfg.schedule, "phase": self.cfg.window_phase, "seed": self.cfg.seed},
            remove_columns=trajectories.column_names,
            desc="jacobi noise schedule",
        )
        longest = max(examples["length"])
        self.pack_length = data_cfg.pack_length or longest
        self.pad_to = data_cfg.pad_to
        if longest > self.pack_length:
            raise DataError(
                f"a Jacobi Forcing sample takes {longest} slots (prompt + 2 x blocks x block_size) > "
                f"data.pack_length={self.pack_length}; raise data.pack_length or lower recipe.max_new_tokens"
            )
        return examples

    def _collect(self, tokenized, model) -> Path:
        """Collect this stage's trajectories with ``model`` (this rank's shards), then wait for all ranks."""
        if model is None:
            raise ConfigError(
                "Jacobi Forcing collects trajectories with the model; none was passed (set recipe.trajectories_dir)"
            )
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            raise ConfigError(
                "the model is partitioned (ZeRO-3): collect trajectories beforehand with "
                "pardec/cli/collect_trajectories.py and set recipe.trajectories_dir"
            )
        prompts = self.collect_prompts(tokenized)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if torch.cuda.is_available():
            model.to(torch.device("cuda", torch.cuda.current_device()))
        collect_trajectories(model, prompts, self.cfg.collect_dir, self.collect_settings(), rank, world)
        barrier()
        return Path(self.cfg.collect_dir)

    def collate(self, examples):
        return build_jacobi_batch(
            examples,
            block_size=self.cfg.block_size,
            pack_length=self.pack_length,
            pad_to=self.pad_to,
            pad_token_id=self.tokenizer.pad_token_id,
            mask=self.cfg.mask,
            window=self.cfg.window,
            layout=self.cfg.layout,
        )

    def loss(self, model, batch):
        logits = forward_logits(model, batch)  # [r, s, V]
        total, logs = jacobi_forcing_loss(
            logits, batch["labels"], batch["pc_student_index"], batch["pc_teacher_index"], batch["n_blocks"],
            self.cfg.ar_weight,
        )
        return total, {"loss": total.item(), **logs}

    def export_metadata(self):
        return {"recipe": self.name, "jacobi_block_size": self.cfg.block_size}
