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
