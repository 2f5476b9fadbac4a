PYTHON ?= python3

.PHONY: test lint bench install-test-deps

# The README's test command: install what the tests need, check lint and types, then run the tests.
test: install-test-deps lint
	$(PYTHON) -m pytest

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

install-test-deps:
	bash scripts/install-test-deps.sh

bench:
	$(PYTHON) -m pytest bench --benchmark-only -q
