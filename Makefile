# ddptrain: `make demo` trains on CPU with bundled data, `make test` runs the test suite.
# Both create .venv first. torch is installed alone and pinned before anything else, so
# that no later requirement lets pip resolve a multi-GB CUDA build on a CPU machine.

# The interpreter .venv is made from: python3, or a 3.12 where python3 is older and one is
# installed with pyenv (scripts/python.sh says why); PYTHON=... chooses.
PYTHON ?= $(shell scripts/python.sh)
VENV   := .venv
PY     := $(VENV)/bin/python
RUNTIME := $(VENV)/.runtime-0.5
STAMP  := $(VENV)/.installed-0.5

.PHONY: setup demo test test-fast test-slow test-heavy lint typecheck clean mutants docs docs-serve \
	docs-run docs-screenshots

setup: $(STAMP)

# torch (pip takes the CPU build) and numpy first, alone; then ddptrain through uv, which
# resolves, downloads and compiles on every core (about 45 s where pip takes 3 on 2 cores) and
# keeps the installed torch, pinned. Modules are compiled at install: where
# PYTHONDONTWRITEBYTECODE is set (as on CI), nothing compiled later is kept, and each
# process would compile them again. The demo needs the runtime alone (ddptrain and its
# curves); the tests, lint and typecheck add the dev toolchain (transformers, Ray, MLflow,
# W&B, kubernetes, torchao, pytest, ruff, mypy) on top.
$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0 numpy uv
	$(PY) -m uv pip install --quiet --python $(PY) --compile-bytecode -e '.[viz]' torch==2.13.0
	touch $(RUNTIME)

$(STAMP): $(RUNTIME)
	$(PY) -m uv pip install --quiet --python $(PY) --compile-bytecode -e '.[dev,viz]' torch==2.13.0
	touch $(STAMP)

demo: $(RUNTIME)
	$(VENV)/bin/ddprun --standalone --nproc_per_node=2 -m ddptrain train \
		--dataset breast_cancer --batch_size 8 --epochs 10 \
		--output_dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# The suite in tiers by what a test costs (tests/conftest.py), each test in exactly one:
# `make test` runs the fast tier, then the multi-process one; `make test-heavy` the
# heaviest end-to-end runs. CI (.ci/run) runs lint, typecheck, the fast tier, the slow
# tier, then the heavy one: docs/TESTING.md.
test: test-fast test-slow

# The multi-process tiers run two tests at a time (pytest-xdist): a test of several
# processes leaves a core idle for a third of its time (launchers importing torch alone,
# ranks waiting on a peer, a timeout, a daemon). A module that starts a cluster of its own
# keeps its tests on one worker (tests/conftest.py). TEST_WORKERS=0 runs them one by one.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

# Pure logic and single-process runs (about 3 minutes): what to run while editing.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# Real process groups, torchrun, the CLI end to end (about 6 minutes on 2 cores).
test-slow: $(STAMP) slurm-deps
	$(PY) -m pytest -q -m "slow and not heavy" $(XDIST) --durations=15

# The heaviest multi-process runs: kills and resumes, 4-rank layouts, Slurm, namespaces.
test-heavy: $(STAMP) slurm-deps
	$(PY) -m pytest -q -m heavy $(XDIST) --durations=25

# Does the suite catch realistic bugs? Each mutant listed in scripts/mutants.py (a small
# change to the code and the tests that should catch it) is planted in a copy of the tree,
# one at a time; the table says whether the fast and the slow tier caught it. Not part of
# CI. ARGS=--fast-only (a few minutes), ARGS="--only NAME", ARGS=--list.
mutants: $(STAMP)
	$(PY) scripts/mutants.py --python $(PY) $(ARGS)

# Slurm and munge for the Slurm tests (tests/test_slurm.py), iptables for the network
# partitions of tests/test_multinode.py: installed only when missing, and only by root with
# apt-get; anywhere else nothing happens and those tests skip.
SLURM_PKGS := slurmctld slurmd slurm-client munge iptables

.PHONY: slurm-deps
slurm-deps:
	@if { ! command -v slurmctld >/dev/null 2>&1 || ! command -v iptables >/dev/null 2>&1; } \
		&& [ "$$(id -u)" = 0 ] \
		&& command -v apt-get >/dev/null 2>&1; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq --no-install-recommends $(SLURM_PKGS) >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 \
		     && apt-get install -y -qq --no-install-recommends $(SLURM_PKGS) >/dev/null 2>&1; } \
		|| true; \
	fi

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf runs .pytest_cache

# The documentation site (docs/, mkdocs.yml) into site/: the flag reference is written from
# TrainingConfig and the command reference from the commands' parsers first
# (scripts/flag_reference.py, scripts/docs_commands.py, through the hook in mkdocs.yml), and
# a broken link or anchor fails the build. docs-serve rebuilds it as you edit.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve

# Every shell and python block of README.md and docs/ runs on CPU, page by page in a scratch
# directory (scripts/docs_run.py), but those marked `<!-- docs: no-run (REASON) -->` (a GPU,
# a cluster, a long run), whose syntax and flags are checked only. About 3 minutes on 2 cores.
docs-run: $(STAMP)
	$(PY) scripts/docs_run.py

# docs/assets/home.png and how-to.png, the built site drawn by headless Chromium (Debian's
# `chromium` package): scripts/docs_screenshots.py.
docs-screenshots: docs
	$(PY) scripts/docs_screenshots.py

# Benchmarks: ddptrain against a hand-written DDP loop, Lightning Fabric and HF Accelerate
# (bench/run.py; writes docs/BENCHMARKS.md and docs/benchmarks.png). The competitors live
# in their own virtual environment: they are never dependencies of ddptrain. torch is
# pinned on every install line so that nothing replaces the tested CPU build.
BENCH_VENV  := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-0.1
PIP_FLAGS   := --quiet --disable-pip-version-check

.PHONY: bench bench-setup gpu-check

# On a machine with CUDA (about 17 minutes on one H200; see bench/gpu_check.py for two calls): every training path that fits
# one GPU checked against a CPU reference, the CUDA-only tests, and a ~1.1B Llama-style
# model's tokens/s, MFU and peak memory (bench/gpu_check.py). It runs under this venv's
# python when there is one, else under the machine's python3 and its torch; without CUDA it
# says so and exits 0. `python bench/gpu_check.py --report_only runs/gpu-check/gpu_check.json`
# writes the GPU section of docs/BENCHMARKS.md from its figures.
gpu-check:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) bench/gpu_check.py --out runs/gpu-check

bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install $(PIP_FLAGS) torch==2.13.0 numpy
	$(BENCH_VENV)/bin/python -m pip install $(PIP_FLAGS) torch==2.13.0 lightning accelerate -e '.[viz]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python bench/run.py --repeats 3
	$(BENCH_VENV)/bin/python bench/sharding.py
	$(BENCH_VENV)/bin/python bench/checkpoints.py
	$(BENCH_VENV)/bin/python bench/recompute.py
	$(BENCH_VENV)/bin/python bench/layouts.py
	$(BENCH_VENV)/bin/python bench/layouts_raw.py
	$(BENCH_VENV)/bin/python bench/moe.py
	$(BENCH_VENV)/bin/python bench/cp.py
	$(BENCH_VENV)/bin/python bench/step_costs.py
