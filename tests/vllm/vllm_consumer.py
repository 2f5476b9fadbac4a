"""A real kvxfer Consumer in its own process, with a paged cache shaped like vLLM's CPU cache, driven through a
pipe. It never imports vLLM. (Module name is unique on purpose: tests/vllm has no __init__.py, so that this
directory can never shadow the real ``vllm`` package.)"""

from __future__ import annotations

from dataclasses import dataclass

from procs import PipedProcess, serve


@dataclass(frozen=True)
class CacheSpec:
    """Per-layer ``[num_blocks, kv_heads, block_size, C]`` tensors (contiguous, as vLLM's LBHNC on CPU)."""

    num_blocks: int = 32
    layers: int = 2
    kv_heads: int = 2
    block_size: int = 16
    c: int = 128  # 2 * head_size: K and V of a token side by side
    dtype: str = "bfloat16"

    def tensors(self):
        """Per-layer views over numpy memory, typed bf16 for the fingerprint (no torch import: fast spawn)."""
        import numpy as np

        from kvxfer.memory import TensorView

        shape = (self.num_blocks, self.kv_heads, self.block_size, self.c)
        assert self.dtype == "bfloat16"
        out = {}
        for i in range(self.layers):
            a = np.full(shape, 0xC0E0, dtype=np.uint16)  # bf16 -7.0: a sentinel no producer writes
            out[f"model.layers.{i}.self_attn.attn"] = TensorView(
                a.ctypes.data, shape, a.strides, 2, "bfloat16", owner=a
            )
        return out


def block_stream(layout, block: int) -> bytes:
    """A block's byte stream (every segment in order), read straight out of a host KVLayout."""
    from kvxfer.memory import host_buffer

    bufs = [host_buffer(r) for r in layout.regions]
    out = bytearray()
    for r, off, stride, n in zip(
        layout.seg_region.tolist(),
        layout.seg_offset.tolist(),
        layout.seg_stride.tolist(),
        layout.seg_bytes.tolist(),
        strict=True,
    ):
        start = off + block * stride
        out += bytes(bufs[r][start : start + n])
    return bytes(out)


def _main(conn, spec: CacheSpec, transport: str, options: dict) -> None:
    from kvxfer import Consumer, KVLayout

    layout = KVLayout.from_tensors(spec.tensors())
    consumer = Consumer(layout, transport=transport, **options)

    def get(timeout, release):
        a = consumer.get(timeout)
        blocks = [block_stream(layout, int(b)) for b in a.block_ids.tolist()]
        if release:
            consumer.release(a.req)
        return {
            "req": a.req,
            "ids": a.block_ids.tolist(),
            "meta": a.meta,
            "nbytes": a.nbytes,
            "digests": len(a.digests),
            "blocks": blocks,
        }

    try:
        serve(conn, consumer.address, {"stats": consumer.stats, "get": get, "release": consumer.release})
    finally:
        consumer.close()


class ConsumerProcess(PipedProcess):
    what = "consumer process"

    def __init__(self, spec: CacheSpec = CacheSpec(), transport: str = "tcp", **options):
        self.spec = spec
        super().__init__(_main, spec, transport, options)
        self.address = self.ready

    def get(self, timeout: float = 10, release: bool = True) -> dict:
        return self.call("get", timeout, release, timeout=timeout + 10)

    def stats(self) -> dict:
        return self.call("stats")

    def release(self, req: str) -> bool:
        return self.call("release", req)
