"""Put on the PYTHONPATH of a vLLM server with NixlConnector by the end-to-end tests: two adaptations of
NixlConnector to one 2-core machine that runs two such servers, in the server processes only.

- NIXL agents start without their progress thread. nixl 1.5.1 starts that thread with no back-off: every idle
  vLLM worker then holds a core, and NixlConnector's handshakes time out (5 s). vLLM builds its agent config
  without this switch; kvxfer's own agents set it explicitly.
- NixlConnector's worker does not pin its thread. On a CPU platform it calls ``os.sched_setaffinity(0, ...)``
  with the last core of each NUMA node ("reserve different cores for start_load_kv() from model_forward()"),
  which pins vLLM's worker main thread, and every thread started from it later, to that core. vLLM means one
  instance per NUMA node; here both instances' workers landed on core 1, each spinning on its step queue between
  steps, and runnable threads of the other instance got no CPU for 16 s while core 0 idled: the 10-56 s decode
  stalls of docs/serving.md. Skipping that one call (this machine has one NUMA node) ended them.
"""

import os
import sys

os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # what vLLM sets when it imports nixl first
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
try:
    from nixl import _api
except ImportError:  # no NIXL in this environment: nothing to change
    pass
else:
    _init = _api.nixl_agent_config.__init__

    def _no_progress_thread(self, *args, **kwargs):
        kwargs["enable_prog_thread"] = False
        _init(self, *args, **kwargs)

    _api.nixl_agent_config.__init__ = _no_progress_thread


_NIXL_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"  # nixl/base_worker (0.32), nixl_connector
_setaffinity = os.sched_setaffinity


def _unless_nixl_worker(pid, cpus):
    if pid == 0 and sys._getframe(1).f_globals.get("__name__", "").startswith(_NIXL_WORKER):
        return
    _setaffinity(pid, cpus)


os.sched_setaffinity = _unless_nixl_worker
