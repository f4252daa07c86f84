#!/usr/bin/env bash
# bash scripts/real_model_gpu.sh [--smoke]   (one CUDA GPU, after: pardec-import smollm2-135m-instruct)
# The GPU variants on SmolLM2-135M-Instruct, each step skipped when its output exists: AR fine-tuning
# (experiment=smollm2_sft_gpu) and its accuracy on EVAL_SPLITS (default "val test", empty for none: val to choose on,
# test reported), then
# - IDLM=1 (the default): the I-DLM conversion and (RISD=1, the default) the R-ISD gated LoRA on that
#   base, then AR greedy against ISD N=4 (and R-ISD) on PROBLEMS test problems, twice: every row's
#   decode step captured as a CUDA graph (--cuda-graphs), then eager;
# - MDM=1 (default 0): the MDM conversion, MDM_ATTENTION=block (the default: experiment=smollm2_mdm_gpu,
#   block-causal in blocks of 2), block32 (smollm2_mdm_block32_gpu) or bidir (smollm2_mdm_bidir_gpu,
#   decoded in blocks of 32), then the tables named in MDM_TABLES, in that order (default "flashdlm
#   cover"): the FlashDLM table (pardec.benchmarks.mdm_flashdlm; MDM_ROWS: its --rows, default all), in
#   each of DECODE_MODES (graphs: gpu_mdm_flashdlm*_graphs_<gpu>; eager: gpu_mdm_flashdlm*_<gpu>), and
#   the COVER table (pardec.benchmarks.cover with the base's AR row: tau_draft chosen on COVER_VAL val
#   problems, default 10), in each of DECODE_MODES (graphs: gpu_cover*_graphs_<gpu>; eager: gpu_cover*_<gpu>),
#   both on PROBLEMS test problems; the block32 and bidir runs' tables are named gpu_*_block32_<gpu> and
#   gpu_*_bidir_<gpu> (before the graphs suffix).
# - JACOBI=1 (default 0): the Jacobi Forcing conversion (experiment=smollm2_jacobi_forcing_gpu: trajectories
#   collected 32 prompts at a time, one round at n=8), then the Jacobi Forcing table
#   (pardec.benchmarks.jacobi_forcing: n among 4, 8, 16 chosen on JACOBI_VAL val problems, default 10, for
#   Jacobi and for multi-block on its own; AR greedy, Jacobi and multi-block rows) on PROBLEMS test problems,
#   in each of DECODE_MODES (graphs: every row's decode step captured as a CUDA graph, --cuda-graphs).
# - REFUSION=1 (default 0): the ReFusion conversion (experiment=smollm2_refusion_gpu), then the ReFusion
#   table (pardec.benchmarks.refusion, the first CPU run's settings: b=16, tau among 0.9/0.7/0.5 chosen on
#   REFUSION_VAL val problems, default 10, every row with speculative completion as the CPU pipeline's, then
#   the chosen tau, its KV-recomputation ablation and the paper's completion, completion_drafts=0) on
#   PROBLEMS test problems, in each of DECODE_MODES (graphs: gpu_refusion_graphs_<gpu>; eager:
#   gpu_refusion_<gpu>). Runs after Jacobi Forcing: with both, a time limit stops ReFusion first.
# DECODE_MODES (default "graphs eager") names the I-DLM, FlashDLM, COVER, Jacobi Forcing and ReFusion tables'
# decoding modes, in that order ("graphs" alone saves the eager table's minutes in a short device session).
# THREADS (default 8): the benchmarks' CPU threads (--threads; 2 for a --smoke run on a 2-core machine).
# Decoding is fp32, so "lossless" is checked token for token without bf16 rounding. Tables go to
# benchmarks/results/real/gpu_*_<gpu>, the training commands' wall times (and the trainer's summed training
# seconds) to gpu_conversions_<gpu>.json
# (a conversion's entry once its tables are written, replacing the same run's from an earlier session: a
# conversion stopped before its tables leaves the entry of the one the tables show; the SFT base's first
# entry stays: the summary's AR row is of that session's base), their
# whole output to runs/real_gpu_train.log (kept when a time limit stops a conversion).
# --smoke runs every step with a few steps and problems under *_smoke names (a check of the script
# itself, on any device).
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3}
tag="" tiny_data=() tiny_steps=() tiny_stages=() problems=${PROBLEMS:-30} eval_n=200 out=benchmarks/results/real
splits=${EVAL_SPLITS-val test} with_risd=${RISD:-1} with_idlm=${IDLM:-1} with_mdm=${MDM:-0} with_refusion=${REFUSION:-0}
refusion_val=${REFUSION_VAL:-10} with_jacobi=${JACOBI:-0} jacobi_val=${JACOBI_VAL:-10}
mdm_attention=${MDM_ATTENTION:-block} mdm_tables=${MDM_TABLES:-flashdlm cover} mdm_rows=${MDM_ROWS:-all}
cover_val=${COVER_VAL:-10} decode_modes=${DECODE_MODES:-graphs eager} threads=${THREADS:-8}
case $threads in ''|*[!0-9]*|0*) echo "THREADS must be a positive integer, got '$threads'" >&2; exit 2 ;; esac
case $mdm_attention in
  block) mdm_experiment=smollm2_mdm_gpu mdm_suffix="" ;;
  block32) mdm_experiment=smollm2_mdm_block32_gpu mdm_suffix=_block32 ;;
  bidir) mdm_experiment=smollm2_mdm_bidir_gpu mdm_suffix=_bidir ;;
  *) echo "MDM_ATTENTION must be block, block32 or bidir, got '$mdm_attention'" >&2; exit 2 ;;
esac
for mode in $decode_modes; do
  case $mode in graphs|eager) ;; *) echo "DECODE_MODES: unknown mode '$mode' (graphs, eager)" >&2; exit 2 ;; esac
done
for table in $mdm_tables; do
  case $table in flashdlm|cover) ;; *) echo "MDM_TABLES: unknown table '$table' (flashdlm, cover)" >&2; exit 2 ;; esac
done
if [ "${1:-}" = "--smoke" ]; then
  tag=_smoke problems=2 eval_n=2 cover_val=2 refusion_val=2 jacobi_val=2 out=runs/smoke_results
  tiny_data=(trainer.micro_batch_size=2 data.max_train_samples=32 trainer.warmup_steps=0) tiny_steps=(trainer.max_steps=2)
  tiny_stages=("recipe.stages=[{name:stride2,max_steps:1,overrides:{stride:2,alpha:0.2}},{name:stride4,max_steps:1,overrides:{stride:4,alpha:null}}]")
fi
mkdir -p "$out" runs  # runs/ (the walls file, the training log, the checkpoints) is not in a fresh clone
sft=runs/smollm2_sft_gpu$tag risd=runs/smollm2_risd_gpu$tag idlm=runs/smollm2_idlm_gpu$tag mdm=runs/${mdm_experiment}$tag
refusion=runs/smollm2_refusion_gpu$tag jacobi=runs/smollm2_jacobi_forcing_gpu$tag
last_stage=$([ -n "$tag" ] && echo 01-stride4 || echo 02-stride4)
gpu=$($py -c "import torch; print(torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else 'cpu')")
walls=runs/real_gpu_walls$tag.tsv  # <run> <wall seconds> [<training seconds>], one line per finished training command
train_log=runs/real_gpu_train$tag.log  # every training command's whole output (the screen gets its last lines)

stamp() { echo "[$(date +%H:%M:%S)] $*"; }
write_walls() {  # write_walls <run>...: the named runs' wall times from this session's walls file into the JSON
  $py - "$walls" "$out/gpu_conversions_$gpu.json" "$@" <<'PY'
import json, os, sys
walls, out, *runs = sys.argv[1:]
saved = json.load(open(out)) if os.path.exists(out) else {}  # earlier sessions' runs on this GPU model stay
rows = [line.split("\t") for line in open(walls).read().splitlines()] if os.path.exists(walls) else []
new = {name: {"wall_seconds": int(seconds), **({"training_seconds": float(training[0])} if training else {})}
       for name, seconds, *training in rows if name in runs}
# Every session fine-tunes its own SFT base: the first one saved stays (the summary's AR row decodes with that
# session's base); a later session's base time is in its walls file and log.
new = {name: entry for name, entry in new.items() if not (name.startswith("smollm2_sft_gpu") and name in saved)}
open(out, "w").write(json.dumps({**saved, **new}, indent=2) + "\n")
PY
}
train() {  # train <run dir> <overrides...>: skipped when the run (its last stage) is done
  local done_file=$1; shift
  if [ -f "$done_file" ]; then stamp "done already: $done_file"; return; fi
  stamp "pardec-train $*"
  local start=$SECONDS from
  touch "$train_log"; from=$(($(wc -c <"$train_log") + 1))  # this command's output starts at byte $from
  $py -m pardec.cli.train "$@" logging.progress_bar=false 2>&1 | tee -a "$train_log" | grep -v -E "^\s*$" | tail -n 25
  # the trainer logs "stage <dir>: N steps in T s of training" per stage: their sum is the training time
  local training
  training=$(tail -c +$from "$train_log" | awk 'match($0, /steps in [0-9.]+ s of training/) {
    split(substr($0, RSTART, RLENGTH), w, " "); t += w[3]; n++ } END { if (n) printf "%.1f", t }')
  stamp "wall $((SECONDS - start)) s${training:+ ($training s of training)}: $*"
  printf '%s\t%s%s\n' "$(basename "$(dirname "$done_file" | sed 's|/stages/.*||')")" $((SECONDS - start)) \
    "${training:+$'\t'$training}" >>"$walls"
}

train $sft/DONE experiment=smollm2_sft_gpu experiment_name=smollm2_sft_gpu$tag "${tiny_data[@]}" "${tiny_steps[@]}"
write_walls smollm2_sft_gpu$tag
for split in $splits; do
  [ -f $sft/eval_$split/metrics.json ] || $py -m pardec.cli.validate checkpoint=$sft/hf decoder=ar_greedy \
    decoder.batch_size=64 decoder.max_new_tokens=96 data.eval_split=$split data.max_eval_samples=$eval_n \
    agreement=false progress=false output_dir=$sft/eval_$split >$sft/eval_$split.log 2>&1
  stamp "SFT base, $split: $(tr -d " \n" <$sft/eval_$split/metrics.json)"
done
if [ "$with_idlm" = 1 ]; then
  # I-DLM first: the 2026-11-26 H100 run measured R-ISD and ran out of device time in I-DLM's last stage.
  train $idlm/stages/$last_stage/DONE experiment=smollm2_idlm_gpu experiment_name=smollm2_idlm_gpu$tag model.path=$sft/hf \
    "${tiny_data[@]}" "${tiny_stages[@]}"
  risd_args=()
  if [ "$with_risd" = 1 ]; then
    train $risd/DONE experiment=smollm2_risd_gpu experiment_name=smollm2_risd_gpu$tag model.path=$sft/hf "${tiny_data[@]}" "${tiny_steps[@]}"
    risd_args=(--risd $risd/hf)
  fi
  for mode in $decode_modes; do
    stamp "benchmark ($mode): AR greedy vs ISD N=4 (I-DLM)${risd_args:+ vs R-ISD}, $problems test problems"
    $py -m pardec.benchmarks.idlm_isd --base $sft/hf --idlm $idlm/stages/$last_stage/hf "${risd_args[@]}" \
      --num-samples "$problems" --strides 4 --no-sample --device auto --dtype float32 --threads "$threads" \
      $([ $mode = graphs ] && echo "--cuda-graphs --no-bound") --out $out/gpu_idlm_isd_${mode}_$gpu$tag
  done
  write_walls smollm2_idlm_gpu$tag smollm2_risd_gpu$tag
fi
if [ "$with_mdm" = 1 ]; then
  train $mdm/DONE experiment=$mdm_experiment experiment_name=$mdm_experiment$tag model.path=$sft/hf \
    "${tiny_data[@]}" "${tiny_steps[@]}"
  for table in $mdm_tables; do
    if [ $table = flashdlm ]; then
      for mode in $decode_modes; do
        stamp "benchmark ($mode): AR greedy vs the MDM decoders (FlashDLM table, rows $mdm_rows), $problems test" \
          "problems"
        $py -m pardec.benchmarks.mdm_flashdlm --base $sft/hf --mdm $mdm/hf --num-samples "$problems" \
          --rows "$mdm_rows" --device auto --dtype float32 --threads "$threads" \
          $([ $mode = graphs ] && echo --cuda-graphs) \
          --out $out/gpu_mdm_flashdlm${mdm_suffix}$([ $mode = graphs ] && echo _graphs)_$gpu$tag
      done
    else
      for mode in $decode_modes; do
        stamp "benchmark ($mode): AR greedy vs the COVER table, tau_draft on $cover_val val problems, $problems" \
          "test problems"
        $py -m pardec.benchmarks.cover --base $sft/hf --mdm $mdm/hf --num-samples "$problems" \
          --num-validation "$cover_val" --device auto --dtype float32 --threads "$threads" \
          $([ $mode = graphs ] && echo --cuda-graphs) \
          --out $out/gpu_cover${mdm_suffix}$([ $mode = graphs ] && echo _graphs)_$gpu$tag
      done
    fi
  done
  write_walls $mdm_experiment$tag
fi
if [ "$with_jacobi" = 1 ]; then
  smoke_prompts=()
  [ -n "$tag" ] && smoke_prompts=("recipe.stages=[{name:round1,max_steps:2,overrides:{block_size:8,prompt_start:0,num_prompts:8}}]")
  train $jacobi/stages/00-round1/DONE experiment=smollm2_jacobi_forcing_gpu experiment_name=smollm2_jacobi_forcing_gpu$tag \
    model.path=$sft/hf "${tiny_data[@]}" "${smoke_prompts[@]}"
  for mode in $decode_modes; do
    stamp "benchmark ($mode): AR greedy vs Jacobi / multi-block (Jacobi Forcing, n on $jacobi_val val problems), $problems test problems"
    $py -m pardec.benchmarks.jacobi_forcing --base $sft/hf --round1 $jacobi/stages/00-round1/hf --wide-block-size 0 \
      --num-samples "$problems" --num-val "$jacobi_val" --val-block-sizes 4 8 16 --choose-multiblock-n \
      --no-training-table --no-bound \
      --device auto --dtype float32 --threads "$threads" $([ $mode = graphs ] && echo --cuda-graphs) \
      --out $out/gpu_jacobi_forcing_${mode}_$gpu$tag
  done
  write_walls smollm2_jacobi_forcing_gpu$tag
fi
if [ "$with_refusion" = 1 ]; then
  train $refusion/DONE experiment=smollm2_refusion_gpu experiment_name=smollm2_refusion_gpu$tag model.path=$sft/hf \
    "${tiny_data[@]}" "${tiny_steps[@]}"
  for mode in $decode_modes; do
    stamp "benchmark ($mode): AR greedy vs ReFusion (tau on $refusion_val val problems), $problems test problems"
    $py -m pardec.benchmarks.refusion --base $sft/hf --refusion $refusion/hf --num-samples "$problems" \
      --num-val "$refusion_val" --block-sizes 16 --first-tokens mask --thresholds 0.9 0.7 0.5 --max-drop 0.03 \
      --completion-drafts all --test-chosen-only --ablations kv_reuse completion_drafts --no-own-ar \
      --goal-drop 0.03 --goal-reuse 2 --max-new-tokens 96 \
      --device auto --dtype float32 --threads "$threads" $([ $mode = graphs ] && echo --cuda-graphs) \
      --out $out/gpu_refusion$([ $mode = graphs ] && echo _graphs)_$gpu$tag
  done
  write_walls smollm2_refusion_gpu$tag
fi
stamp "finished; conversion wall times: $out/gpu_conversions_$gpu.json"
