PYTHON ?= python3

.PHONY: test lint bench install-test-deps

# The README's test command: install what the tests need, check lint and types, then run the tests: the quiet
# ones alone, then the end-to-end ones beside the rest, those over ucx in processes of their own
# (scripts/run-tests.sh says why).
test: install-test-deps lint
	PYTHON=$(PYTHON) bash scripts/run-tests.sh

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

install-test-deps:
	bash scripts/install-test-deps.sh

bench:
	$(PYTHON) -m pytest bench --benchmark-only -q
