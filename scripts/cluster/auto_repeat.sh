#!/usr/bin/env bash
# Issue 11: the interleaved quiet repeat of `layout: auto` (docs/hourglass.md "Session 13", "Session 14").
# Runs the bench specs named on the command line (configs/bench/NAME.yaml), in order; default the
# session-14 pair. Each is ABCABC = data-parallel SGC, Hourglass + SGC, auto, twice, on 4 emulated
# hosts at 100 Mbit/s:
#   1. VGG-16 (width 0.25, CONV-heavy; the Hourglass loses)  configs/bench/vgg16_4h_hourglass_auto_s1{3,4}.yaml
#   2. AlexNet-style (FC-heavy; the Hourglass about ties/wins) configs/bench/cifar_alexnet_4h_hourglass_auto_s1{3,4}.yaml
# Each bench saves docs/benchmarks/NAME.partial.json after every cell, so a cut run keeps its cells.
# The second bench starts only if at least MIN_LEFT_S (default 300 s) remain before DEADLINE (a UTC
# time such as 07:30; default: no deadline).
# Then scripts/hourglass_auto_repeats.py prints, per repeat, the time per epoch without and WITH the
# start-up (epoch + launch - wall), auto / better on both bases, and auto's choice and start-up phases.
# Usage (quiet slot, no nice):  flock /work/coord/cluster.lock scripts/cluster/auto_repeat.sh [NAME ...]
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TF_CPP_MIN_LOG_LEVEL=2
PY=${PY:-.venv/bin/python}
HGSGC=${HGSGC:-.venv/bin/hgsgc}
DEADLINE=${DEADLINE:-}
MIN_LEFT_S=${MIN_LEFT_S:-300}
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(vgg16_4h_hourglass_auto_s14 cifar_alexnet_4h_hourglass_auto_s14)
left_s() { [ -z "$DEADLINE" ] && { echo 999999; return; }; echo $(( $(date -u -d "$DEADLINE" +%s) - $(date -u +%s) )); }
for name in "${NAMES[@]}"; do
  if [ "$(left_s)" -lt "$MIN_LEFT_S" ]; then echo "[auto_repeat] skip $name: $(left_s) s left before $DEADLINE"; continue; fi
  echo "[auto_repeat] $name start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  "$HGSGC" bench "configs/bench/$name.yaml"
  echo "[auto_repeat] $name end $(date -u +%T) rc $? load $(cut -d' ' -f1 /proc/loadavg)"
done
for name in "${NAMES[@]}"; do
  f=docs/benchmarks/$name.json; [ -e "$f" ] || f=docs/benchmarks/$name.partial.json
  [ -e "$f" ] || continue
  echo "[auto_repeat] $f"
  "$PY" scripts/hourglass_auto_repeats.py "$f" --runs runs/bench --out "docs/benchmarks/${name}_repeats.json" || true
done
