# The two commands of the README: `make serve` and `make test`. Each installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test bench proto

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh

serve: $(STAMP)
	$(VENV)/bin/genserve serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m benchmarks.engine

proto: $(STAMP)
	$(PY) scripts/gen_proto.py
