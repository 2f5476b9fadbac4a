"""The serving pieces around the transport core: the router (``kvxfer-router``), decode-pool discovery in etcd,
and the reference decode endpoint (``kvxfer-decode``).

They need the ``router`` extra (starlette, uvicorn, httpx, prometheus-client, etcd3gw); the core (``kvxfer``,
``kvxfer.transports``, ``kvxfer.runtime``) never imports them and needs only msgspec and numpy.
"""
