# The two commands of README.md: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	scripts/setup.sh $(VENV)

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/kvgate demo $(DEMO_ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
