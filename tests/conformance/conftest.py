import numpy as np
import pytest

from kvxfer import Consumer

from .kvspec import Spec
from .peers import ConsumerProcess, ProducerProcess

SENTINEL = 0xAB
# Suite-wide consumer settings: short quarantine so one-sided transports free failed blocks quickly.
CONSUMER_OPTIONS = {"quarantine": 0.2, "deadline": 20.0}
DEFAULT_SPEC = Spec()  # immutable, so one instance serves every default
# Every transport's parallel path forced on small transfers: TCP windows, NIXL lanes (each ignores the other's)
PARALLEL = {"streams": 3, "window_min": 4096, "lanes": 3, "lane_min": 4096}


class LocalConsumer:
    """A Consumer in the test process over sentinel-filled memory, so tests can read its blocks."""

    def __init__(self, spec: Spec, transport: str, **options):
        self.spec = spec
        tensors, kw, self.views, self.raw = spec.build(fill=SENTINEL)
        self.layout = spec.layout(tensors, kw)
        self.c = Consumer(self.layout, transport=transport, **{**CONSUMER_OPTIONS, **options})
        self.address = self.c.address

    def __getattr__(self, name):
        return getattr(self.c, name)


@pytest.fixture
def consumers(transport):
    made = []

    def make(spec: Spec = DEFAULT_SPEC, **options) -> LocalConsumer:
        c = LocalConsumer(spec, transport, **options)
        made.append(c)
        return c

    yield make
    for c in made:
        c.c.close()


@pytest.fixture
def producers(transport):
    made = []

    def make(spec: Spec = DEFAULT_SPEC, seed: int = 0, **options) -> ProducerProcess:
        p = ProducerProcess(spec, transport, seed=seed, **options)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def remote_consumers(transport):
    made = []

    def make(spec: Spec = DEFAULT_SPEC, **options) -> ConsumerProcess:
        c = ConsumerProcess(spec, transport, **{**CONSUMER_OPTIONS, **options})
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def source_views(spec: Spec, seed: int = 0):
    return spec.build(seed=seed)[2]


def pick(pattern: str, n: int, num_blocks: int, rng) -> np.ndarray:
    if pattern == "sequential":
        start = int(rng.integers(0, num_blocks - n + 1))
        return np.arange(start, start + n)
    if pattern == "fragmented":
        return np.sort(rng.choice(num_blocks, n, replace=False))
    return rng.permutation(num_blocks)[:n]
