#!/usr/bin/env bash
# Install everything hgsgc needs on a fresh Debian machine (run as root, or with sudo available).
# Idempotent: every step checks what is already there, so a second run takes seconds.
#   - Debian packages: Open MPI, cmake, the Fashion-MNIST data set, iproute2; for the experiments:
#     bible-kjv (King James text, PTB-format default), espeak-ng (synthetic speech default),
#     slurmctld slurmd slurm-client munge (the local Slurm test)
#   - .venv with pinned tensorflow-cpu 2.15.1, numpy<2, mpi4py and the test/plot libraries
#   - horovod 0.28.1 built from source with TensorFlow + MPI; the wheel is cached in
#     $HGSGC_WHEEL_CACHE (default ~/.cache/hgsgc/wheels) so it is built once per machine
#   - hgsgc itself (editable, console script `hgsgc`) with its custom TensorFlow ops
#   - the offline default data sets in their real formats, in $HGSGC_DATA (default
#     ~/.cache/hgsgc/data): scripts/prepare_data.py (skips what is already there)
# Fails loudly (non-zero exit, one line naming the step) when a step or the final check fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${HGSGC_VENV:-$ROOT/.venv}"
PY="${HGSGC_PYTHON:-python3.11}"
CACHE="${HGSGC_WHEEL_CACHE:-$HOME/.cache/hgsgc/wheels}"
HOROVOD_VERSION=0.28.1
APT_PACKAGES="openmpi-bin libopenmpi-dev cmake dataset-fashion-mnist iproute2 make g++ \
  bible-kjv bible-kjv-text espeak-ng slurmctld slurmd slurm-client munge"

die() { echo "install.sh: ERROR: $*" >&2; exit 1; }
step() { echo "==> $*"; }

# 1. Debian packages ----------------------------------------------------------------------------
missing=""
for p in $APT_PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  step "apt-get install$missing"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || die "apt-get update failed"
  $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null || die "apt-get install$missing failed"
else
  step "Debian packages present"
fi

# 2. virtualenv ---------------------------------------------------------------------------------
command -v "$PY" >/dev/null || die "$PY not found: install Python 3.11 (Horovod 0.28.1 + TF 2.15 need it)"
if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PY" -m venv "$VENV" || die "python -m venv failed"
fi
VPY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"

REQ="$ROOT/requirements.txt"
REQ_STAMP="$VENV/.hgsgc-requirements.sha256"
req_hash="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ ! -f "$REQ_STAMP" ] || [ "$(cat "$REQ_STAMP")" != "$req_hash" ]; then
  step "pip install -r requirements.txt"
  "$VPY" -m pip install -q --upgrade pip setuptools wheel || die "pip upgrade failed"
  "$VPY" -m pip install -q -r "$REQ" || die "pip install -r requirements.txt failed"
  echo "$req_hash" > "$REQ_STAMP"
else
  step "Python requirements present"
fi

# 3. Horovod from source, wheel cached ------------------------------------------------------------
if ! "$VPY" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null \
   || ! "$VPY" -c "import horovod.tensorflow as h; assert h.mpi_built() and h.tensorflow_built()" 2>/dev/null; then
  mkdir -p "$CACHE"
  wheel="$(ls "$CACHE"/horovod-$HOROVOD_VERSION-*.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$wheel" ]; then
    step "building horovod $HOROVOD_VERSION from source with TensorFlow + MPI (a few minutes, once)"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITHOUT_GLOO=1 MAKEFLAGS="-j$(nproc)" \
      "$VPY" -m pip wheel -q --no-build-isolation --no-deps --no-binary horovod \
        -w "$CACHE" "horovod==$HOROVOD_VERSION" || die "building the horovod wheel failed"
    wheel="$(ls "$CACHE"/horovod-$HOROVOD_VERSION-*.whl | head -n1)"
  fi
  step "installing $(basename "$wheel")"
  "$VPY" -m pip install -q --no-deps --force-reinstall "$wheel" || die "installing $wheel failed"
  # horovod's own runtime dependencies (without letting pip touch TensorFlow)
  "$VPY" -m pip install -q cloudpickle psutil pyyaml packaging || die "horovod runtime deps failed"
else
  step "horovod $HOROVOD_VERSION present"
fi

# 4. hgsgc itself (editable) with its custom ops -------------------------------------------------
SRC_STAMP="$VENV/.hgsgc-src.sha256"
src_hash="$( (cat setup.py ops/*.cc ops/*.h 2>/dev/null || true) | sha256sum | cut -d' ' -f1)"
if [ ! -f "$SRC_STAMP" ] || [ "$(cat "$SRC_STAMP")" != "$src_hash" ] || [ ! -x "$VENV/bin/hgsgc" ] \
   || ! ls hgsgc/_ops*.so >/dev/null 2>&1; then
  step "pip install -e . (builds ops/)"
  "$VPY" -m pip install -q --no-deps --no-build-isolation -e . || die "pip install -e . failed"
  echo "$src_hash" > "$SRC_STAMP"
else
  step "hgsgc present"
fi

# 5. Offline default data sets (idempotent: each set has a .done stamp) ---------------------------
step "offline data sets in ${HGSGC_DATA:-$HOME/.cache/hgsgc/data}"
TF_CPP_MIN_LOG_LEVEL=2 "$VPY" scripts/prepare_data.py || die "scripts/prepare_data.py failed"

# 6. Check what was built ----------------------------------------------------------------------
check="$("$VENV/bin/horovodrun" --check-build 2>&1)" || die "horovodrun --check-build failed: $check"
echo "$check" | grep -q "\[X\] TensorFlow" || die "horovod was built without TensorFlow: $check"
echo "$check" | grep -q "\[X\] MPI" || die "horovod was built without MPI: $check"
"$VPY" -c "import hgsgc, hgsgc.ops as o; o.load()" || die "hgsgc or its custom ops do not import"
ls /usr/share/datasets/fashion-mnist/*.gz >/dev/null 2>&1 || ls /usr/share/datasets/fashion-mnist/* >/dev/null 2>&1 \
  || die "Fashion-MNIST data missing under /usr/share/datasets/fashion-mnist (Debian package dataset-fashion-mnist)"
step "install OK: horovod $HOROVOD_VERSION with TensorFlow + MPI, hgsgc $("$VPY" -c 'import hgsgc; print(hgsgc.__version__)')"
