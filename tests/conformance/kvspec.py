"""KV cache layouts for the conformance suite, rebuilt identically in every process from a small spec."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer import KVLayout

KINDS = ("nhd", "hnd", "mla", "kv_separate", "kv_leading", "heads_outer", "cross_layer")
DTYPES = {"float16": 2, "float32": 4, "uint8": 1, "bfloat16": 2}


@dataclass(frozen=True)
class Spec:
    kind: str = "nhd"
    num_blocks: int = 64
    layers: int = 3
    heads: int = 2
    block_size: int = 4
    head_dim: int = 8
    dtype: str = "float16"
    lib: str = "numpy"

    def build(self, fill: int | None = None, seed: int = 0):
        """(tensors as handed to KVLayout.from_tensors, from_tensors kwargs, per-layer logical views).

        ``fill`` None fills with seeded random bytes (a producer), else with that byte (a consumer's sentinel).
        """
        nb, L, H, bs, D = self.num_blocks, self.layers, self.heads, self.block_size, self.head_dim
        if self.kind == "mla":
            H, C = 1, D * 2 + 8
        else:
            C = 2 * D
        kw: dict = {"block_size": bs, "dims": "BHND"}  # what each dim of the tensors handed over means
        if self.kind == "cross_layer":
            phys = [(nb, L, bs, H, C)]
            kw["dims"] = "BLNHD"
        elif self.kind == "kv_separate":
            phys = [(nb, bs, H, D)] * (2 * L)
            kw["dims"] = "BNHD"
        elif self.kind == "kv_leading":
            phys = [(2, nb, bs, H, D)] * L
            kw["dims"] = "KBNHD"
        elif self.kind == "hnd":
            phys = [(nb, H, bs, C)] * L
        elif self.kind == "heads_outer":
            phys = [(H, nb, bs, C)] * L
        else:  # nhd, mla
            phys = [(nb, bs, H, C)] * L
        raw = [_bytes(shape, self.dtype, None if fill is None else fill, seed + i) for i, shape in enumerate(phys)]
        if self.lib == "torch":
            import torch

            raw = [
                torch.from_numpy(a).view(getattr(torch, self.dtype))
                if self.dtype == "bfloat16"
                else torch.from_numpy(a)
                for a in raw
            ]
        elif self.dtype == "bfloat16":
            raise ValueError("bfloat16 needs lib='torch'")
        if self.kind == "cross_layer":
            tensors = raw[0]
            kw["num_layers"] = L
            views = [raw[0][:, i] for i in range(L)]
        elif self.kind == "kv_separate":
            tensors = [(raw[2 * i], raw[2 * i + 1]) for i in range(L)]
            views = [(raw[2 * i], raw[2 * i + 1]) for i in range(L)]
        elif self.kind == "kv_leading":
            tensors = raw
            views = [(a[0], a[1]) for a in raw]
        elif self.kind == "heads_outer":
            tensors = [_perm(a, (1, 0, 2, 3)) for a in raw]
            views = tensors
        elif self.kind in ("nhd", "mla"):
            tensors = [_perm(a, (0, 2, 1, 3)) for a in raw]  # vLLM's logical [nb, H, bs, C] over NHD memory
            views = tensors
        else:
            tensors = raw
            views = raw
        return tensors, kw, views, raw

    def layout(self, tensors, kw) -> KVLayout:
        return KVLayout.from_tensors(tensors, **kw)


def _perm(a, order):
    return a.permute(*order) if hasattr(a, "permute") else a.transpose(order)


def _bytes(shape, dtype: str, fill: int | None, seed: int) -> np.ndarray:
    itemsize = DTYPES[dtype]
    n = int(np.prod(shape)) * itemsize
    if fill is None:
        buf = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    else:
        buf = np.full(n, fill, dtype=np.uint8)
    np_dtype = {"float16": np.float16, "float32": np.float32, "uint8": np.uint8, "bfloat16": np.uint16}[dtype]
    return buf.view(np_dtype).reshape(shape)


def as_bytes(view) -> np.ndarray:
    """A logical block-major view as uint8 of shape [num_blocks, bytes] (copying; for checks only)."""
    if hasattr(view, "numpy"):
        import torch

        view = view.view(torch.uint8) if view.dtype == torch.bfloat16 else view
        view = view.numpy()
    a = np.ascontiguousarray(view)
    return a.view(np.uint8).reshape(a.shape[0], -1)


def block_bytes(views, ids) -> list[np.ndarray]:
    """The bytes of blocks ``ids`` in every layer (and K/V part), for comparing two sides."""
    out = []
    for v in views:
        for part in v if isinstance(v, tuple) else (v,):
            out.append(as_bytes(part)[np.asarray(ids)])
    return out


def untouched(views, granted, fill: int) -> bool:
    """Whether every block not in ``granted`` still holds only the sentinel byte ``fill``."""
    keep = np.ones(as_bytes(views[0][0] if isinstance(views[0], tuple) else views[0]).shape[0], dtype=bool)
    keep[np.asarray(granted, dtype=np.int64)] = False
    for v in views:
        for part in v if isinstance(v, tuple) else (v,):
            if not (as_bytes(part)[keep] == fill).all():
                return False
    return True
