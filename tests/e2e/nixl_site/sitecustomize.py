"""Put on a vLLM server's PYTHONPATH by the end-to-end tests: NIXL agents start without their progress thread.

nixl 1.5.1 starts that thread with no back-off: on a 2-core machine every idle vLLM worker then holds a core, and
NixlConnector's handshakes time out (5 s). vLLM builds its agent config without this switch, so the default is
changed here, in the server process only. kvxfer's own agents set it explicitly.
"""

import os

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
