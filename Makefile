# vllm-tiercache developer commands. `make setup` is idempotent; `make test` and `make demo` call it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tiercache-setup-stamp

.PHONY: setup test demo lint bench clean-venv redis docs

setup: $(STAMP) redis

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@extra=$$(bash scripts/detect_extra.sh); echo "tiercache setup: installing with extra [$$extra]"; \
	  $(PY) -m pip install -q -e ".[$$extra,dev]" && \
	  if [ "$$extra" = cpu ]; then \
	    $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true; \
	  fi
	$(PY) -c "import vllm, vllm_tiercache.shared, vllm_tiercache.kvcache, vllm_tiercache.eccache; print('tiercache setup: vllm', vllm.__version__)"
	@touch $(STAMP)

redis:
	@bash scripts/ensure_redis.sh

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

demo: setup
	$(VENV)/bin/tiercache demo

bench: setup
	$(VENV)/bin/tiercache bench tiers

lint: setup
	$(VENV)/bin/ruff check vllm_tiercache shared kvcache eccache tools tests

# the generated tables of docs/configuration.md, from the config classes (tests/test_config_schema.py checks)
docs: $(STAMP)
	$(VENV)/bin/tiercache config schema --update-docs docs/configuration.md

clean-venv:
	rm -rf $(VENV)
