# The two commands a new user types: `make run` and `make test`.
PYTHON ?= python3
# The CPU build of PyTorch, for the reference tests (these machines carry it as a local file).
TORCH ?= torch==2.13.0
PROMPT ?= What is the capital of France?

.PHONY: setup setup-test run test

setup:
	$(PYTHON) -m pip install -q -e ".[gguf]"

setup-test:
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test,gguf]"

run: setup
	$(PYTHON) -m jax_offload.generate --prompt "$(PROMPT)"

test: setup-test
	$(PYTHON) -m jax_offload.default_model
	$(PYTHON) -m pytest -n 2 tests
