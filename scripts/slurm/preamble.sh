# source scripts/slurm/preamble.sh   (sourced by the templates in scripts/slurm/, in the batch shell, from the repository root)
# The launch preamble the Slurm templates share. It sets
#   PYTHON          the interpreter: $PARDEC_PYTHON, default .venv/bin/python (no activated venv needed)
#   NPROC_PER_NODE  processes per node: $PARDEC_NPROC_PER_NODE, default the GPUs Slurm granted this
#                   job per node (read from the controller, so a SLURM_GPUS_ON_NODE exported in the
#                   submitting shell does not leak in), or 1 when it granted none (a CPU node)
# and defines `pardec_launch MODULE_ARGS...`: one srun task per node running torchrun
# (pardec/cli/launch.py, which exits with the workers' exit code) with NPROC_PER_NODE workers; only
# local rank 0 prints to the job log, every rank's full output is kept in <job log>.ranks/.

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "pardec: not inside a Slurm job (submit with sbatch scripts/slurm/<template>.sbatch ...)" >&2
  exit 2
fi

PYTHON="${PARDEC_PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
  echo "pardec: no Python at '$PYTHON' (in $PWD): run bash scripts/setup.sh, or set PARDEC_PYTHON" >&2
  exit 2
fi

granted_gpus_per_node() {  # from the job's TRES (cpu=..,node=2,gres/gpu=16): total / nodes; 0 without GPUs
  local total
  total="$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *TRES=//p' | tr ',' '\n' | sed -n 's|^gres/gpu=||p' | head -n 1)"
  echo $(( ${total:-0} / ${SLURM_JOB_NUM_NODES:-1} ))
}

if [ -n "${PARDEC_NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE="$PARDEC_NPROC_PER_NODE"
else
  NPROC_PER_NODE="$(granted_gpus_per_node)"
  [ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=1
fi
case "$NPROC_PER_NODE" in
  '' | *[!0-9]* | 0) echo "pardec: PARDEC_NPROC_PER_NODE='$NPROC_PER_NODE' is not a positive integer" >&2; exit 2 ;;
esac

job_log="$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *StdOut=//p' | head -n 1)"
RANK_LOG_DIR="${job_log:-$PWD/slurm-$SLURM_JOB_ID.out}.ranks"
echo "pardec: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES:-1} node(s)," \
  "$NPROC_PER_NODE process(es) per node; all ranks' output: $RANK_LOG_DIR"

pardec_launch() {
  local rendezvous
  if [ "${SLURM_JOB_NUM_NODES:-1}" -eq 1 ]; then
    rendezvous=(--standalone)
  else
    rendezvous=(--nnodes "$SLURM_JOB_NUM_NODES" --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d
      --rdzv_endpoint "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):$((20000 + SLURM_JOB_ID % 20000))")
  fi
  srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$PYTHON" -m pardec.cli.launch "${rendezvous[@]}" \
    --nproc_per_node "$NPROC_PER_NODE" --local-ranks-filter 0 --tee 3 --log-dir "$RANK_LOG_DIR" "$@"
}
