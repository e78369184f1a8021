# hgsgc: two commands on a fresh machine (as root):
#   make demo   install everything, then train the main job (SGC, 4 ranks, Fashion-MNIST; layout auto:
#               data parallel or Hourglass, whichever the start-up measurement predicts faster)
#   make test   install everything, then run the test suite (single process and under mpirun)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 4
DEMO_ARGS ?=
# the main job: configs/fashion_mnist_auto.yaml, layout auto (it measures compute, boundary bytes and
# the link at start-up and runs the faster of data-parallel SGC and Hourglass + SGC; docs/hourglass.md,
# "`make demo`": data parallel was faster in every measured main-job cell, auto chose it in each).
# make demo DEMO_ARGS='layout=hourglass hourglass.fc_workers=1' runs the demo before session 21.
DEMO_CONFIG ?= configs/fashion_mnist_auto.yaml
MPIRUN := mpirun --allow-run-as-root --oversubscribe --bind-to none
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test test-fast clean

install:
	bash scripts/install.sh

demo: install
	$(MPIRUN) -np $(NP) -x TF_CPP_MIN_LOG_LEVEL $(VENV)/bin/hgsgc train $(DEMO_CONFIG) $(DEMO_ARGS)

test: install
	bash scripts/run_tests.sh

test-fast: install
	$(PY) -m pytest -q -m "not mpi and not slow" tests

clean:
	rm -rf build *.egg-info hgsgc/_ops*.so runs .pytest_cache
