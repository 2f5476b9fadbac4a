"""The decode side: a receive service a decode runtime embeds (see docs/runtime.md)."""

from .allocator import PagedPool, TokenAllocator, TokenBlocks
from .service import FIRST_TOKEN, NUM_TOKENS, SAMPLING, Handoff, ReceiveService, handoff_meta

__all__ = [
    "FIRST_TOKEN",
    "NUM_TOKENS",
    "SAMPLING",
    "Handoff",
    "PagedPool",
    "ReceiveService",
    "TokenAllocator",
    "TokenBlocks",
    "handoff_meta",
]
