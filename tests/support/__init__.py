"""Tools the tests and the soak run use to catch what must never happen: bad frees, writes after free,
bytes outside a grant, untyped errors; and producers / consumers in child processes that record how
transfers end."""

from .blocks import BlockBytes, content
from .guard import POISON, BadFree, Fault, GuardedAllocator
from .peer import ConsumerChild, ProducerChild, Throttle, watch_untyped

__all__ = [
    "POISON",
    "BadFree",
    "BlockBytes",
    "ConsumerChild",
    "Fault",
    "GuardedAllocator",
    "ProducerChild",
    "Throttle",
    "content",
    "watch_untyped",
]
