# The two commands a new user types: `make run` and `make test`.
# Both install into a virtual environment of their own, .venv in the checkout, made when missing, so a
# package installed by hand elsewhere cannot stand in for one pyproject.toml forgets.
# `make test PYTHON=/path/to/python` uses an environment you manage yourself instead.
VENV := .venv
PYTHON ?= $(VENV)/bin/python
# The CPU build of PyTorch, for the reference tests (these machines carry it as a local file).
TORCH ?= torch==2.13.0
PROMPT ?= What is the capital of France?

# Only the default environment is made here; one named by PYTHON is the caller's.
ifeq ($(PYTHON),$(VENV)/bin/python)
ENVIRONMENT := $(VENV)/bin/python
endif

.PHONY: setup setup-test run serve test

$(VENV)/bin/python:
	python3 -m venv $(VENV)

setup: $(ENVIRONMENT)
	$(PYTHON) -m pip install -q -e ".[gguf]"

setup-test: $(ENVIRONMENT)
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test]"

run: setup
	$(PYTHON) -m jax_offload.generate --prompt "$(PROMPT)"

serve: setup
	$(PYTHON) -m jax_offload.serve $(SERVE_ARGS)

test: setup-test
	$(PYTHON) -m jax_offload.default_model
	$(PYTHON) -m pytest -n 2 --dist loadfile tests
