# vllm-tiercache developer commands. `make setup` is idempotent; `make test` and `make demo` call it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tiercache-setup-stamp

.PHONY: setup test test-fast test-gpu demo lint bench clean-venv redis docs

setup: $(STAMP) redis

$(STAMP): pyproject.toml scripts/install_deps.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@extra=$$(bash scripts/detect_extra.sh); echo "tiercache setup: installing with extra [$$extra]"; \
	  bash scripts/install_deps.sh $(PY) $$extra && \
	  if [ "$$extra" = cpu ]; then \
	    $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true; \
	  fi
	$(PY) -c "import vllm, vllm_tiercache.shared, vllm_tiercache.kvcache, vllm_tiercache.eccache; print('tiercache setup: vllm', vllm.__version__)"
	@touch $(STAMP)

redis:
	@bash scripts/ensure_redis.sh

# The whole suite (what CI runs): scripts/run_tests.sh says how it is split over workers and passes.
test: setup
	PY=$(PY) bash scripts/run_tests.sh

# The inner loop: every test that starts no vLLM engine (about 2.5 min on a 2-core machine).
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $${TEST_WORKERS:-2} -m "not engine" tests

# The CUDA suite (tests/gpu): not part of `test` (CI has no GPU). Without CUDA it says so and fails.
# On a GPU machine without this venv, scripts/gpu-check.sh runs it with the system's torch.
test-gpu: setup
	@$(PY) -c "import sys, torch; ok = torch.cuda.is_available(); print('tiercache test-gpu: CUDA device:', torch.cuda.get_device_name(0) if ok else 'none'); sys.exit(0 if ok else 'tiercache test-gpu: no CUDA device here (torch.cuda.is_available() is False); nothing ran. Run it on a machine with an NVIDIA GPU, e.g. scripts/gpu-check.sh')"
	$(PY) -m pytest -q -p no:cacheprovider --confcutdir=tests/gpu tests/gpu

demo: setup
	$(VENV)/bin/tiercache demo

bench: setup
	$(VENV)/bin/tiercache bench tiers

lint: setup
	$(VENV)/bin/ruff check vllm_tiercache shared kvcache eccache tools tests

# the generated tables of docs/configuration.md, from the config classes (tests/config/test_config_schema.py checks)
docs: $(STAMP)
	$(VENV)/bin/tiercache config schema --update-docs docs/configuration.md

clean-venv:
	rm -rf $(VENV)
