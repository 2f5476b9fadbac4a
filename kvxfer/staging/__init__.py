"""Host staging for memory a socket cannot reach: copy engines and the chunked, pipelined send / receive.

The TCP transport moves CUDA memory through pinned host buffers (docs/transports.md, "TCP from GPU memory"):
``engine`` gathers a window's planned extents into a staging slot and scatters a slot back, asynchronously;
``pipeline`` overlaps the copy of chunk i+1 with the socket moving chunk i. ``engine.HostEngine`` is the same
interface over host memory, so the pipeline's logic runs in CI, where there is no GPU; ``cuda.CudaEngine`` runs
it on a GPU (CUDA streams through torch, the pack kernel of ``native/pack.cu`` through cupy where present).
"""

from .engine import CopyEngine, HostEngine, Pending, Slot, engine_for
from .pipeline import Rings, recv_staged, send_staged

__all__ = ["CopyEngine", "HostEngine", "Pending", "Rings", "Slot", "engine_for", "recv_staged", "send_staged"]
