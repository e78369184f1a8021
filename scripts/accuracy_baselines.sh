#!/usr/bin/env bash
# Full-length accuracy runs of the baselines next to dense and SGC (README "Measured results"):
# 4 ranks on this machine (loopback), 3 epochs of real Fashion-MNIST, seed 42, one run each, then
# one `hgsgc report` table over all of them (runs/accuracy/report.md, accuracy.png, loss.png).
# About 4-6 min per run on a 2-core machine.
#   bash scripts/accuracy_baselines.sh [NAME ...]     # default: every run below
# The README table's byte columns were measured with fixed-width payload indices (the default
# before 2026-12-02), so every run pins compression.index_coding=fixed (accepted with any method;
# lossless: the training is the same bit for bit under today's default Elias-Fano, only the sparse
# payloads' bytes differ). INDEX_CODING=elias_fano bash scripts/accuracy_baselines.sh for today's.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-4}
EPOCHS=${EPOCHS:-3}
INDEX_CODING=${INDEX_CODING:-fixed}
OUT=runs/accuracy
declare -A RUNS=(
  [dense]="configs/fashion_mnist_dense.yaml"
  [topk]="configs/fashion_mnist_dense.yaml compression.method=topk compression.density=0.005"
  [dgc]="configs/fashion_mnist_dense.yaml compression.method=dgc compression.density=0.005 compression.local_clip_norm=5.0 compression.warmup_steps=100"
  [terngrad]="configs/fashion_mnist_dense.yaml compression.method=terngrad"
  [powersgd]="configs/fashion_mnist_dense.yaml compression.method=powersgd compression.powersgd_rank=4"
  [sgc]="configs/fashion_mnist_sgc.yaml"
  [hourglass_sgc]="configs/fashion_mnist.yaml"
  [hourglass_sgc_fp16_pipe4]="configs/fashion_mnist.yaml hourglass.wire_dtype=float16 hourglass.micro_batches=4"
)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(dense topk dgc terngrad powersgd sgc hourglass_sgc hourglass_sgc_fp16_pipe4)
dirs=()
for n in "${names[@]}"; do
  [ -n "${RUNS[$n]:-}" ] || { echo "unknown run '$n': use one of ${!RUNS[*]}" >&2; exit 2; }
  read -r -a args <<< "${RUNS[$n]}"
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP" \
    .venv/bin/hgsgc train "${args[@]}" train.epochs="$EPOCHS" train.progress=false \
    compression.index_coding="$INDEX_CODING" run.out_dir="$OUT" run.id="$n"
  dirs+=("$OUT/$n")
done
.venv/bin/hgsgc report "${dirs[@]}" --out "$OUT"
