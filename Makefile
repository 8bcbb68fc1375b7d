# The two commands of the README: `make serve` and `make test`. Each installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Envoy, Helm, kubectl, kubernetes-validate (scripts/tools.sh): outside the venv, in $(TOOLS_DIR).
TOOLS_DIR ?= .tools
TOOLS_STAMP := $(TOOLS_DIR)/.installed
export GENSERVE_TOOLS_DIR ?= $(abspath $(TOOLS_DIR))

.PHONY: serve test bench proto

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh

$(TOOLS_STAMP): scripts/tools.sh
	TOOLS_DIR=$(TOOLS_DIR) bash scripts/tools.sh

serve: $(STAMP) $(TOOLS_STAMP)
	$(VENV)/bin/genserve serve $(ARGS)

test: $(STAMP) $(TOOLS_STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m benchmarks.engine

proto: $(STAMP)
	$(PY) scripts/gen_proto.py
