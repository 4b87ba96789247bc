# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtiers-installed

.PHONY: test demo lint typecheck pytest clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0" -e ".[dev]"
	# vLLM for the integration tests, the light way: the wheel alone, plus the packages its
	# kv_offload modules import. A plain `pip install vllm` pulls a CUDA torch and ~10 GB.
	$(PY) -m pip install -q --no-deps "vllm==0.33.0"
	$(PY) -m pip install -q "msgspec==0.23.0" "psutil==7.2.2" "pyzmq==27.3.0" "regex==2026.11.19"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy kvtiers

pytest: $(STAMP)
	$(PY) -m pytest -q

test: lint typecheck pytest

demo: $(STAMP)
	$(VENV)/bin/kvtiers demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
