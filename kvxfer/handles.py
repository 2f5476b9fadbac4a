"""The handles a vLLM connector and a decode runtime hold, under the module name of kvxfer 0.1.

They live in ``transfer`` (Transfer, Arrival, Status), ``producer`` and ``consumer``; import them from
``kvxfer`` itself.
"""

from .consumer import Consumer
from .producer import Producer
from .transfer import Arrival, Status, Transfer

__all__ = ["Arrival", "Consumer", "Producer", "Status", "Transfer"]
