"""The TCP transport keeps working in a process with more than FD_SETSIZE (1024) open descriptors, as a serving
process (vLLM, many sockets) or a long test session is."""

import os
import resource

import numpy as np
import pytest

from kvxfer import Consumer, KVLayout, Producer


def test_tcp_push_with_descriptors_above_fd_setsize():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(
        resource.RLIMIT_NOFILE,
        (max(soft, 1300) if hard == resource.RLIM_INFINITY else min(max(soft, 1300), hard), hard),
    )
    filler = []
    try:
        while True:
            fd = os.open(os.devnull, os.O_RDONLY)
            filler.append(fd)
            if fd > 1100:
                break
        src = np.arange(8 * 4 * 256, dtype=np.uint8).reshape(8, 4, 256) % 251
        dst = np.zeros_like(src)
        with (
            Consumer(KVLayout.from_tensors([dst], block_size=4), transport="tcp") as c,
            Producer(KVLayout.from_tensors([src], block_size=4), transport="tcp") as p,
        ):
            p.push(c.address, "r", [1, 5, 6], deadline=10).wait()
            a = c.get(10)
            assert np.array_equal(dst[a.block_ids], src[[1, 5, 6]])
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
