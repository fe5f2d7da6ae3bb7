# The README's two set-up commands: `make run` and `make test`. Both install the system packages
# they need when missing (scripts/system-deps: bubblewrap, util-linux; chromium for the tests),
# create or reuse .venv and install the project into it, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers: most tests wait on processes and sockets, so more workers than cores pays.
TEST_WORKERS ?= 3

.PHONY: run test test-under-load lint typecheck unit docs bench bytecode clean system-run system-test swe-mini \
	upstream

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,ray,docs]'
	touch $(STAMP)

system-run:
	@scripts/system-deps run

system-test:
	@scripts/system-deps test

# rollcage's own bytecode: an editable install has none, and where PYTHONDONTWRITEBYTECODE=1
# (containers, CI) every `rollcage` start would compile the package from source again
# (~100 ms of CPU). compileall writes it all the same, and skips what is up to date.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q src/rollcage

run: system-run $(STAMP) bytecode
	$(BIN)/rollcage run examples/calc-weather/dataset.jsonl --out runs/quickstart

# examples/swe-mini end to end: task images built offline from Debian's packages and PyPI sdists,
# pushed to a local registry, each bug fixed by the scripted policy and graded by the task's tests.
swe-mini: system-test $(STAMP) bytecode
	$(BIN)/python examples/swe-mini/run.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# Side environments with the upstream projects' own code (NeMo Gym, Harbor, Inspect AI) for the
# conformance tests; on a machine without Python 3.13 it says so and those tests skip.
upstream:
	@scripts/upstream-envs

unit: system-test $(STAMP) upstream
	ROLLCAGE_TEST_NO_SKIPS=1 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup

# The documentation site, into site/: --strict turns a broken link, a missing page or an API
# reference that does not resolve into a failure. The CLI, configuration and schema reference
# pages are generated from the code while it builds (scripts/docs_hooks.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

test: lint typecheck docs unit

# The whole suite beside a busy loop on every core (HOGS_PER_CORE=2 for more): it must pass.
test-under-load: system-test $(STAMP)
	scripts/with-cpu-hog $(MAKE) --no-print-directory test

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
