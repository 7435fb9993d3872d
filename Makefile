# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test demo bench install clean embedded-model

# jaxllm and what it needs to run (the demo, the CLI, the API).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(STAMP)

# The test extras (pytest, hypothesis, notebook runner, pyarrow) on top.
DEV_STAMP := $(VENV)/.dev-stamp
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(DEV_STAMP)

# The converter tests compare against transformers' PyTorch models; the library never needs torch.
TORCH_STAMP := $(VENV)/.torch-stamp
$(TORCH_STAMP): $(DEV_STAMP)
	$(PY) -m pip install -q "torch==2.13.0"
	touch $(TORCH_STAMP)

install: $(STAMP)

# --durations: the 15 slowest tests are listed, so a slow suite is visible.
test: $(TORCH_STAMP)
	$(PY) -m pytest --durations=15

# The main job on the embedded models (jaxllm/models, trained by the train package): the
# embedded corpus through dense / window / StreamingLLM / recompute caches and StreamingLLM on
# INT8; prints perplexity, tokens/s and memory, writes demo_out/demo.{json,png}, generates text.
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
