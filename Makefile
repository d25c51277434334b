# One command sets up and runs the pipelines (`make run`), one sets up and passes the tests (`make test`).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TINY_LLAMA := models/tiny-llama

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-fast plan validate benchmark clean

setup: $(VENV)/.installed $(TINY_LLAMA)/config.json

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch's ~2,300 modules compiled on every core, not one at a time as pip does (9 s against 24 on 2 cores,
	# the same bytecode files); one of its test helpers is Python 3.12 syntax, which neither compiles
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch" || true
	# The project and its ~200 packages through uv, which installs the same set in 20 s against pip's 49 on 2
	# cores; pip where uv cannot. torch stays with pip above: uv does not read pip's configuration (a local
	# find-links of CPU wheels). setuptools' "Editable installation" notice (a banner pip shows even with -q)
	# says nothing to act on.
	{ $(BIN)/pip install -q uv==0.13.9 \
	  && $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode -c constraints.txt -e '.[dev]'; } \
	  || PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $@

$(TINY_LLAMA)/config.json: scripts/make_tiny_llama.py data/calibration.txt | $(VENV)/.installed
	$(BIN)/python scripts/make_tiny_llama.py $(TINY_LLAMA)

run: setup
	$(BIN)/smelter run

plan: setup
	$(BIN)/smelter plan

validate: setup
	$(BIN)/smelter validate

# Tests run in TEST_WORKERS pytest-xdist workers, each with its own servers and stores. On 2 cores, 3: more
# workers run more processes at once and each costs more CPU (the suite took 11.0 min with 3, 11.6-12.7 with 4,
# 14.6 with 6).
TEST_WORKERS ?= 3
# The suite starts a few hundred Python processes from this checkout; each compiles its modules again where the
# environment turns bytecode caching off (PYTHONDONTWRITEBYTECODE), so the tests keep Python's default.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest

test: setup
	$(PYTEST) -q -n $(TEST_WORKERS) --dist worksteal

test-fast: setup
	$(PYTEST) -q -n $(TEST_WORKERS) --dist worksteal -m "not slow"

benchmark: setup
	$(BIN)/smelter run --pipeline minilm
	$(BIN)/python benchmarks/minilm_speedup.py
	$(BIN)/python benchmarks/benchmark_cost.py
	$(BIN)/python benchmarks/decision_sensitivity.py
	$(BIN)/python benchmarks/decision_stability.py
	$(BIN)/python benchmarks/warm_rerun.py
	$(BIN)/python benchmarks/process_start.py
	$(BIN)/python benchmarks/int8_cpu_formats.py
	$(BIN)/python benchmarks/promotion_overhead.py --pipeline minilm
	$(BIN)/python benchmarks/fleet_roundtrip.py
	$(BIN)/python benchmarks/program_load.py

clean:
	rm -rf artifacts/*/ mlruns mlflow.db
