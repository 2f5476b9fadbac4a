import os

import pytest

from kvxfer import transports

ALL_TRANSPORTS = ("tcp", "nixl")


def transport_params():
    return [pytest.param(name, id=name) for name in ALL_TRANSPORTS]


@pytest.fixture(params=transport_params())
def transport(request):
    """Every transport runs the same conformance suite. In CI an unavailable transport fails, not skips."""
    name = request.param
    if name not in transports.available():
        if os.environ.get("CI"):
            pytest.fail(f"transport {name!r} is not available in CI")
        pytest.skip(f"transport {name!r} not available here")
    return name


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The test run's last step: a process that loaded NIXL (kvxfer's agents, vLLM's NixlConnector) ends here
    with pytest's status, before NIXL's native teardown can crash it (exit_before_native_teardown)."""
    if _EXIT_STATUS in config.stash:
        from kvxfer.transports.nixl import exit_before_native_teardown

        exit_before_native_teardown(config.stash[_EXIT_STATUS])
