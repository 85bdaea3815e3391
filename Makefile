# The two commands of README.md: `make demo` and `make test`. Both set up .venv first; `make test` also installs
# the real SGLang engine its real-engine tests start (scripts/setup-engine.sh; KVGATE_SKIP_ENGINE=1 skips it).
VENV ?= .venv
PY := $(VENV)/bin/python
ENGINE_VENV ?= $(or $(KVGATE_ENGINE_VENV),.venv-engine)
export KVGATE_ENGINE_VENV := $(abspath $(ENGINE_VENV))

.PHONY: setup engine demo test clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	scripts/setup.sh $(VENV)

setup: $(VENV)/.installed

engine:
	scripts/setup-engine.sh $(ENGINE_VENV)

demo: $(VENV)/.installed
	$(VENV)/bin/kvgate demo $(DEMO_ARGS)

test: $(VENV)/.installed engine
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .engine
