PYTHON ?= python3

.PHONY: test lint bench install-test-deps

# The README's test command: install what the tests need, check lint and types, then run the tests: those over
# ucx in a process of their own (ucxx's UCX and NIXL's do not share a process; docs/transports.md).
test: install-test-deps lint
	$(PYTHON) -m pytest -m "not ucx"
	$(PYTHON) -m pytest -m ucx

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

install-test-deps:
	bash scripts/install-test-deps.sh

bench:
	$(PYTHON) -m pytest bench --benchmark-only -q
