# Two entry points: `make demo` and `make test`. Everything they need is installed here, from PyPI and
# Debian only. torch is pinned (torch==2.13.0): pip here resolves that pin to the machine's local CPU wheel, and an
# unpinned torch would pull a multi-GB CUDA build. Elsewhere, install the CPU build first if you want it:
#   .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
OLAH_VENV := .venv-olah
OLAH_STAMP := $(OLAH_VENV)/.installed-stamp
PORT ?= $(or $(GRADIO_SERVER_PORT),7860)
# The library asks for torch>=2.4; the checkout pins one version (see the top of this file).
TORCH_PIN := torch==2.13.0
# The corpus extra's engines (zoo score-corpus on Ray Data, the datatrove blocks): the versions tested.
CORPUS_PINS := ray==2.60.0 datatrove==0.10.1
CONSTRAINTS := $(VENV)/constraints.txt
# The checkout's folders, given to the library through the environment of this venv's interpreter (a .pth file):
# the library itself assumes no repository layout. Also the lm_eval hook (`lm_eval --model zoo`): its module and
# .pth, which the wheel installs at the root of site-packages but an editable install does not carry (see
# zoo/tools/wheel_build.py), linked there so that the venv runs the checkout's sources.
CHECKOUT_STAMP := $(VENV)/.checkout-stamp
HOOK_FILES := zoo/tools/lm_eval_hook/alstm_zoo_lm_eval_hook.py zoo/tools/lm_eval_hook/alstm_zoo_lm_eval_hook.pth
DATA_DIR ?= $(abspath ../shared/data)

.PHONY: demo test test-fast venv system-deps olah lint bench clean help docs

help:
	@echo "make demo   - create .venv, install, start the Gradio demo on 127.0.0.1:$(PORT) (offline)"
	@echo "make test   - create .venv, install (plus Java 17, HAProxy and Chromium where missing), run the suite"
	@echo "make test-fast - the unit tier only (pytest -m unit: in-process, no server, about two minutes on one core)"
	@echo "make venv   - create .venv and install (the checkout's sources, editable) without running anything"
	@echo "make system-deps - Java 17, HAProxy and Chromium from Debian where missing (TorchServe, its front door, the browser test)"
	@echo "make olah   - the local Hub mirror's own venv (.venv-olah) for the Hub tests"
	@echo "make lint   - ruff"
	@echo "make docs   - build the docs site into site/ (mkdocs build --strict: every link and anchor checked)"
	@echo "make bench  - the inference benchmarks (cells, precision, backends, int8, serving; writes benchmarks/results/*.json);"
	@echo "              the others (training speed, dynamic evaluation, card reproduction, ...) run one by one: benchmarks/*.py"
	@echo "make clean  - remove .venv, .venv-olah and .pytest_cache"

# Each step says what it does before it starts (pip -q is silent for a minute at a time), and nothing else is printed:
# the commands are not echoed (@), and setuptools' banner for editable installs ("Editable installation ... be careful
# with folders in your working directory") is filtered out: it is advice for other layouts, and it read as an error.
$(STAMP): pyproject.toml
	@echo "zoo: [1/4] creating $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip 'setuptools>=77'  # the tests build the wheel without isolation (pyproject's PEP 639 licence)
	@printf '%s\n' $(TORCH_PIN) $(CORPUS_PINS) > $(CONSTRAINTS)
	@echo "zoo: [2/4] installing $(TORCH_PIN) (the CPU build)"
	@$(PY) -m pip install -q -c $(CONSTRAINTS) $(TORCH_PIN)
	@echo "zoo: [3/4] installing the zoo and its extras (editable; a minute or more, silent)"
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[all]'
	@echo "zoo: [4/4] compiling the C++ inference loops, two of them: the aLSTM's and the HyperLSTM's (once; usually 1 to 4 minutes each)"
	@$(VENV)/bin/zoo build-ext || echo "(the C++ inference loops did not build: the Python loops will be used)"
	@touch $(STAMP)

$(CHECKOUT_STAMP): $(STAMP) Makefile $(HOOK_FILES)
	@purelib="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && \
	echo 'import os; os.environ.setdefault("ZOO_DATA_DIR", "$(DATA_DIR)"); os.environ.setdefault("ZOO_EXPORTS_DIR", "$(CURDIR)/exports/out")' \
		> "$$purelib/zoo_checkout.pth" && \
	for f in $(HOOK_FILES); do ln -sfn "$(CURDIR)/$$f" "$$purelib/$$(basename $$f)" || exit 1; done
	@touch $@

venv: $(STAMP) $(CHECKOUT_STAMP)

# olah (the local Hub mirror used by the Hub tests) pins psutil, so it lives in its own venv.
$(OLAH_STAMP):
	$(PYTHON) -m venv $(OLAH_VENV)
	$(OLAH_VENV)/bin/pip install -q olah==0.5.4
	touch $(OLAH_STAMP)

olah: $(OLAH_STAMP)

# Java 17 for TorchServe's frontend, HAProxy for its front door and Chromium for the browser test, from Debian,
# where missing.
system-deps:
	@if ! java -version 2>&1 | grep -qE 'version "(1[7-9]|[2-9][0-9])'; then \
		echo "installing openjdk-17-jdk-headless"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jdk-headless >/dev/null; fi
	@if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then \
		echo "installing haproxy (the serving front door)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; fi
	@if ! command -v chromium >/dev/null; then \
		echo "installing chromium"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi

demo: venv
	@echo "zoo: starting the demo on http://127.0.0.1:$(PORT) (loading the bundled models first)"
	@GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) app.py --port $(PORT)

# Two pytest-xdist workers: on two cores the subprocess- and server-bound tests wait more than they compute (a slice
# of the system tier: 248 s alone, 129 s with -n 2). Each module runs whole in one worker (its server or demo
# started once), except the modules tests/conftest.py shares out test by test (SHARED_OUT_MODULES: it makes the
# groups of `--dist loadgroup`), which fill both workers' ends. `make test XDIST=` runs the suite in one process.
XDIST ?= -n 2 --dist loadgroup
test: venv olah system-deps
	$(PY) -m pytest -q $(XDIST) --durations=25

# The unit tier (tests/conftest.py's MODULE_TIERS): nothing beyond the venv is installed or started. One process
# with one intra-op thread (tiny tensors: a second thread only adds synchronisation): 80 s on one core, where
# two xdist workers did not pay (their start-up and collection cost as much as they saved).
test-fast: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m unit --durations=10

docs: venv
	$(VENV)/bin/mkdocs build --strict --site-dir site

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(PY) benchmarks/cells.py
	$(PY) benchmarks/precision.py --layout --inference
	$(PY) benchmarks/precision_quality.py
	$(PY) benchmarks/backends.py
	$(PY) benchmarks/quantization.py
	$(PY) benchmarks/serving.py

clean:
	rm -rf $(VENV) $(OLAH_VENV) .pytest_cache site
