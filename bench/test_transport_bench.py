"""Per-transport throughput, small: one process, producer and consumer on loopback, every available transport.

The two-process, side-by-side comparison with raw baselines is ``kvxfer-bench``; this suite tracks the
transports' own cost over time: a 64 MiB Llama-3-8B-shaped push and pull, and a one-block round trip.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvxfer import Consumer, Producer, transports
from kvxfer.bench import content, models

GEOM = models.PRESETS["llama-3-8b"]
BLOCKS = 32  # 512 tokens = 64 MiB
_ids = itertools.count()


@pytest.fixture(scope="module", params=transports.available())
def pair_of(request):
    name = request.param
    src, dst = models.allocate(GEOM, BLOCKS), models.allocate(GEOM, BLOCKS)
    c = content.Content(0, GEOM.layers, BLOCKS, GEOM.layer_block_bytes)
    c.fill(src)
    content.poison(dst)
    consumer = Consumer(models.layout_of(GEOM, dst), transport=name)
    producer = Producer(models.layout_of(GEOM, src), transport=name)
    yield name, producer, consumer, c, dst
    producer.close()
    consumer.close()


def _move(producer, consumer, mode, ids):
    req = f"r{next(_ids)}"
    t = (producer.push if mode == "push" else producer.offer)(consumer.address, req, ids)
    t.wait()
    arrival = consumer.get(timeout=30)
    consumer.release(arrival.req)
    return arrival


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_throughput_64mib(benchmark, pair_of, mode):
    name, producer, consumer, c, dst = pair_of
    ids = np.arange(BLOCKS)
    arrival = benchmark.pedantic(_move, args=(producer, consumer, mode, ids), rounds=8, warmup_rounds=1)
    assert c.verify(dst, arrival.block_ids, ids).ok
    benchmark.extra_info["transport"] = name
    benchmark.extra_info["GB/s"] = BLOCKS * GEOM.block_bytes / benchmark.stats.stats.median / 1e9


def test_one_block_round_trip(benchmark, pair_of):
    name, producer, consumer, c, dst = pair_of
    ids = np.array([5])
    arrival = benchmark.pedantic(_move, args=(producer, consumer, "push", ids), rounds=50, warmup_rounds=3)
    assert c.verify(dst, arrival.block_ids, ids).ok
    benchmark.extra_info["transport"] = name
