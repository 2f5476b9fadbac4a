import os

import pytest

from conformance.kvspec import Spec
from conformance.peers import ProducerProcess as Sender
from kvxfer import transports
from local_service import SPEC, Local

ALL_TRANSPORTS = ("tcp", "nixl", "ucx")


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


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the mark given here
def pytest_collection_modifyitems(items):
    """Tests over ucx carry the ``ucx`` mark and run after every other test. ucxx bundles a UCX of its own, and
    the NIXL and vLLM tests here load NIXL's: once ucxx's is in a process it slows every NIXL agent created after
    it (docs/transports.md), and a process should hold one of the two. ``make test`` runs ``-m "not ucx"`` and
    ``-m ucx`` as two processes; a plain ``pytest`` keeps them apart in time at least."""
    late = [
        item for item in items if getattr(item, "callspec", None) and item.callspec.params.get("transport") == "ucx"
    ]
    for item in late:
        item.add_marker(pytest.mark.ucx)
    if late:
        keep = [item for item in items if item not in set(late)]
        items[:] = keep + late


# ---- the receive-service tests (test_runtime, test_multisender) ---------------------------------------------
@pytest.fixture
def service(transport):
    made = []

    def make(spec: Spec = SPEC, **options) -> Local:
        s = Local(spec, transport, **options)
        made.append(s)
        return s

    yield make
    for s in made:
        s.svc.close()


@pytest.fixture(scope="module")
def _shared():
    made = {}
    yield made
    for s in made.values():
        s.close()


@pytest.fixture
def senders(transport, _shared):
    """Producer processes, reused across tests of one transport (spawning costs ~1 s); ``fresh`` for kills."""
    fresh = []

    def get(seed: int = 1, spec: Spec = SPEC, new: bool = False) -> Sender:
        if new:
            fresh.append(Sender(spec, transport, seed))
            return fresh[-1]
        key = (transport, seed, spec)
        if key not in _shared or not _shared[key].proc.is_alive():
            _shared[key] = Sender(spec, transport, seed)
        return _shared[key]

    yield get
    for s in fresh:
        s.close()
    for s in _shared.values():
        if s.proc.is_alive():
            s.call("go")


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
