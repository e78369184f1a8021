# Sourced by the scripts/slurm/*.sbatch templates: start `hgsgc train CONFIG [key=value ...]` on
# every task of the allocation.
#   LAUNCH=srun   (default) direct launch, one MPI rank per Slurm task: srun --mpi=pmix
#                 (with Debian's Open MPI only PMIx works; --mpi=pmi2 fails)
#   LAUNCH=mpirun mpirun inside the allocation (it reads the node list and task counts from Slurm)
#   FC_WORKERS=N  Hourglass configs: the number of FC ranks (hourglass.fc_workers; the last N ranks)
#   HGSGC_VENV    the virtualenv (default: <submit dir>/.venv)
# TensorFlow gets --cpus-per-task threads per rank.
set -euo pipefail
VENV=${HGSGC_VENV:-${SLURM_SUBMIT_DIR:-.}/.venv}
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
hgsgc_launch() {
  local config=$1; shift
  local extra=("train.threads=${SLURM_CPUS_PER_TASK:-1}")
  if [ -n "${FC_WORKERS:-}" ]; then extra+=("hourglass.fc_workers=$FC_WORKERS"); fi
  echo "hgsgc slurm: job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-?}, ${SLURM_NTASKS:-?} tasks, launch ${LAUNCH:-srun}, config $config $*"
  # a requeued job must find its checkpoints: one run id per Slurm job (a run.id argument wins)
  [ -n "${SLURM_JOB_ID:-}" ] && extra=("run.id=slurm-${SLURM_JOB_ID}" "${extra[@]}")
  local cmd
  case "${LAUNCH:-srun}" in
    srun) cmd=(srun --mpi=pmix hgsgc train "$config" "${extra[@]}" "$@") ;;
    mpirun)
      local root=(); [ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
      # -x only for variables that are set (Open MPI warns about an unset one)
      local envs=(); for v in TF_CPP_MIN_LOG_LEVEL PATH PYTHONPATH; do [ -n "${!v+x}" ] && envs+=(-x "$v"); done
      cmd=(mpirun "${root[@]}" --bind-to none "${envs[@]}" \
        hgsgc train "$config" "${extra[@]}" "$@") ;;
    *) echo "hgsgc slurm: LAUNCH=$LAUNCH is invalid: use srun or mpirun" >&2; exit 2 ;;
  esac
  # Preemption (docs/reliability.md): Slurm signals the batch shell (--signal=B:USR1@120 in the templates, or
  # SIGTERM at the time limit); forward it to the ranks as SIGUSR1 (srun and mpirun both pass
  # SIGUSR1 on; mpirun would kill the job on SIGTERM). The ranks agree on a step, write a
  # checkpoint and exit 75; then the job is requeued and resumes (checkpoint.resume=auto).
  "${cmd[@]}" &
  local pid=$! rc=0
  trap 'kill -USR1 "$pid" 2>/dev/null || true' USR1 TERM
  while :; do
    rc=0; wait "$pid" || rc=$?
    kill -0 "$pid" 2>/dev/null || break   # wait returned for a trapped signal: keep waiting
  done
  trap - USR1 TERM
  if [ "$rc" -eq 75 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    echo "hgsgc slurm: preempted: checkpoint written, requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  return "$rc"
}
