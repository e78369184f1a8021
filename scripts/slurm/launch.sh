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
  case "${LAUNCH:-srun}" in
    srun) srun --mpi=pmix hgsgc train "$config" "${extra[@]}" "$@" ;;
    mpirun)
      local root=(); [ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
      mpirun "${root[@]}" --bind-to none -x TF_CPP_MIN_LOG_LEVEL -x PATH -x PYTHONPATH \
        hgsgc train "$config" "${extra[@]}" "$@" ;;
    *) echo "hgsgc slurm: LAUNCH=$LAUNCH is invalid: use srun or mpirun" >&2; exit 2 ;;
  esac
}
