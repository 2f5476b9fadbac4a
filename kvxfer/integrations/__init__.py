"""Integrations of kvxfer into serving engines.

``kvxfer.integrations.vllm``: the vLLM V1 KV connector ``KVXferConnector`` (producer side), loaded by vLLM with
``kv_connector_module_path="kvxfer.integrations.vllm"``. It imports vLLM, so it is not imported here.
"""
