PYTHON ?= python3

.PHONY: test bench install-test-deps

# The README's test command: install what the tests need, then run them.
test: install-test-deps
	$(PYTHON) -m pytest

install-test-deps:
	bash scripts/install-test-deps.sh

bench:
	$(PYTHON) -m pytest bench --benchmark-only -q
