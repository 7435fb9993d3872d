# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test demo bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The converter tests compare against transformers' PyTorch models; the library never needs torch.
TORCH_STAMP := $(VENV)/.torch-stamp
$(TORCH_STAMP): $(STAMP)
	$(PY) -m pip install -q "torch==2.13.0"
	touch $(TORCH_STAMP)

install: $(STAMP)

test: $(TORCH_STAMP)
	$(PY) -m pytest

# Streams the embedded corpus (Python's own docs) through StreamingLLM and window attention.
# Until the training issue ships a trained default model, this uses random weights and says so.
demo: $(STAMP)
	@echo "demo: random-weight pythia-tiny (no trained model ships yet): the numbers show the"
	@echo "      machinery (constant memory, tokens/s), not language-model quality."
	$(VENV)/bin/jaxllm ppl --model random:pythia-tiny --corpus builtin --method streaming \
		--sinks 4 --cache 256 --max-tokens 20000 --json demo_out/streaming.json \
		--plot demo_out/streaming.png
	$(VENV)/bin/jaxllm ppl --model random:pythia-tiny --corpus builtin --method window \
		--cache 256 --max-tokens 20000 --json demo_out/window.json --plot demo_out/window.png
	$(VENV)/bin/jaxllm generate --model random:pythia-tiny --prompt "The for statement" \
		--prompt "and then" --max-new-tokens 32 --sinks 4 --cache 64

bench: $(STAMP)
	$(PY) benchmarks/ppl_memory.py

clean:
	rm -rf $(VENV) demo_out bench_out
