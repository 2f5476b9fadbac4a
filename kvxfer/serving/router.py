"""The lightweight OpenAI-compatible router in front of the pools (``kvxfer-router``).

A low-latency request (header ``X-KVXfer-Route: low-latency``, a model alias, or ``--policy always``) goes to
vLLM for prefill only (``max_tokens=1``, ``return_token_ids``) with the chosen decode endpoint's kvxfer address
in ``kv_transfer_params["kvxfer"]``; the KVXferConnector ships the request's KV there; the router then hands
the request to that decode endpoint (first token id, remaining budget, sampling parameters) and streams its
tokens back in OpenAI format. Every other request is proxied unchanged to the regular pool. Built on
Starlette (ASGI, served by uvicorn) and an ``httpx.AsyncClient``; metrics through ``prometheus_client``.

A transfer that will not complete is acted on at once, never after the decode timeout: the connector's status
in the prefill answer (``kv_transfer_params["kvxfer"]["status"]`` other than ``sending`` / ``done``), or the
decode endpoint's answer that it failed, or was not admitted within ``--admit-timeout`` of the prefill's answer.
The request then goes to the regular pool (``--when-transfer-fails fallback``) or gets 502 with an error body.

Beside that pool of ``kvxfer-decode`` endpoints, a pool of vLLM decode instances (``--vllm-decode``): P/D between two
vLLMs, the decode instance fetching the KV the prefill holds (``vllm_decode.py``). It serves the disaggregated
route when the router has no ``kvxfer-decode`` pool, or when a request asks for it (``X-KVXfer-Route: vllm``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from .auth import DECODE_TOKEN_ENV, ROUTER_TOKEN_ENV, authorized, bearer, guarded, resolve
from .vllm_decode import VLLMDecodePool, claim, not_held

log = logging.getLogger("kvxfer.router")

ROUTE_HEADER = "x-kvxfer-route"
ROUTES = ("low-latency", "vllm")  # the header's values that select the disaggregated route (vllm: that pool)
HOP_HEADERS = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
    "trailer",
    ROUTE_HEADER,
}
# seconds a pooled upstream connection may sit idle before it is dropped: below the 5 s after which uvicorn (and so
# vLLM and the decode endpoint) closes an idle one. At httpx's own 5 s the router sent requests on connections the
# server was closing that very moment, and the decode step failed with a bare ReadError (a 502 in CI).
KEEPALIVE = 2.0
SHIPPING = ("sending", "done")  # the connector's statuses under which the KV is on its way or has arrived
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty")


@dataclass
class Endpoint:
    url: str
    kvxfer: str | None = None
    alive: bool = False
    inflight: int = 0
    free_blocks: int = 0


class _Held:
    """A decode endpoint's (or vLLM decode instance's) in-flight count for one request, given back exactly once."""

    def __init__(self, ep):
        self.ep, self.open, self.streaming = ep, True, False
        ep.inflight += 1

    def end(self) -> None:
        if self.open:
            self.open = False
            self.ep.inflight -= 1


class DecodePool:
    """The decode endpoints: a static list, or discovered in etcd; health-checked through ``/info``."""

    def __init__(
        self,
        urls: list[str],
        etcd: str | None = None,
        prefix: str = "/kvxfer/decode/",
        interval: float = 1.0,
        token: str = "",
    ):
        self.endpoints = {u.rstrip("/"): Endpoint(u.rstrip("/")) for u in urls}
        self.etcd, self.prefix, self.interval = etcd, prefix, interval
        self.headers = bearer(token)  # sent with every request to a decode endpoint

    @property
    def configured(self) -> bool:
        return bool(self.endpoints or self.etcd)

    async def refresh(self, client) -> None:
        if self.etcd:
            from .discovery import list_endpoints

            try:
                found = {e["url"].rstrip("/") for e in await asyncio.to_thread(list_endpoints, self.etcd, self.prefix)}
            except Exception as e:  # keep the last known pool while etcd is unreachable
                log.warning("etcd %s unreachable: %s", self.etcd, e)
            else:
                for url in found - set(self.endpoints):
                    self.endpoints[url] = Endpoint(url)
                for url in set(self.endpoints) - found:
                    del self.endpoints[url]
        await asyncio.gather(*(self._probe(client, ep) for ep in list(self.endpoints.values())))

    async def _probe(self, client, ep: Endpoint) -> None:
        try:
            r = await client.get(f"{ep.url}/info", headers=self.headers, timeout=1.0)
            if r.status_code == 401 and ep.alive:
                log.warning("decode endpoint %s refuses the router's token", ep.url)
            info = r.json()
            ep.kvxfer, ep.free_blocks, ep.alive = info["kvxfer"], int(info.get("free_blocks", 0)), True
        except Exception:  # unreachable or garbage: not a candidate until it answers again
            ep.alive = False

    def candidates(self) -> list[Endpoint]:
        return sorted((e for e in self.endpoints.values() if e.alive and e.kvxfer), key=lambda e: e.inflight)

    async def run(self, client) -> None:
        while True:
            await self.refresh(client)
            await asyncio.sleep(self.interval)


class Router:
    def __init__(
        self,
        prefill: str,
        regular: str | None,
        pool: DecodePool,
        *,
        policy: str = "header",
        alias: str | None = None,
        when_busy: str = "reject",
        when_failed: str = "error",
        prefill_timeout: float = 120.0,
        decode_timeout: float = 60.0,
        admit_timeout: float = 1.0,
        digests: bool = False,
        admin_token: str = "",
        vllm_pool: VLLMDecodePool | None = None,
        vllm_connector: str = "kvxfer",
    ):
        import httpx
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.prefill = prefill.rstrip("/")
        self.regular = (regular or prefill).rstrip("/")
        self.pool = pool
        self.vllm_pool, self.vllm_connector = vllm_pool, vllm_connector
        self.policy, self.alias, self.when_busy, self.when_failed = policy, alias, when_busy, when_failed
        self.prefill_timeout, self.decode_timeout, self.admit_timeout = prefill_timeout, decode_timeout, admit_timeout
        self.digests = digests
        self.admin_token = admin_token
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(prefill_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=1000, keepalive_expiry=KEEPALIVE),
        )
        self._background: set[asyncio.Task] = set()
        self.registry = CollectorRegistry()
        self.requests = Counter("kvxfer_router_requests", "Requests by route", ["route"], registry=self.registry)
        self.errors = Counter("kvxfer_router_errors", "Failed requests by stage", ["stage"], registry=self.registry)
        self.ttft = Histogram("kvxfer_router_ttft_seconds", "Time to first token", ["route"], registry=self.registry)

    # ---- routing ----------------------------------------------------------------------------------------------
    def low_latency(self, request, body: dict) -> bool:
        if self.policy == "always":
            return True
        if self.policy == "never":
            return False
        if request.headers.get(ROUTE_HEADER, "").lower() in ROUTES:
            return True
        return bool(self.alias) and body.get("model") == self.alias

    async def proxy(self, request, path: str, content: bytes):
        """Forward a request unchanged to the regular pool, streaming the answer back."""
        from starlette.background import BackgroundTask
        from starlette.responses import StreamingResponse

        self.requests.labels("regular").inc()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = self.client.build_request(
            request.method, f"{self.regular}{path}", content=content, headers=headers, params=request.query_params
        )
        try:
            resp = await self.client.send(upstream, stream=True)
        except Exception as e:
            self.errors.labels("regular").inc()
            return _error(502, f"regular pool unreachable: {e}", "upstream_error")
        out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        return StreamingResponse(
            resp.aiter_raw(), status_code=resp.status_code, headers=out, background=BackgroundTask(resp.aclose)
        )

    async def _reserve(self, tokens: int) -> Endpoint | None:
        for ep in self.pool.candidates():
            try:
                r = await self.client.post(
                    f"{ep.url}/v1/reserve", json={"tokens": tokens}, headers=self.pool.headers, timeout=2.0
                )
            except Exception:  # dead since the last probe: skip it
                ep.alive = False
                continue
            if r.status_code == 200:
                return ep
        return None

    def to_vllm(self, request) -> bool:
        """The disaggregated route goes to the vLLM decode pool: asked for, or the only decode pool there is."""
        if self.vllm_pool is None:
            return False
        return request.headers.get(ROUTE_HEADER, "").lower() == "vllm" or not self.pool.configured

    async def serve(self, request, path: str):
        content = await request.body()
        try:
            body = json.loads(content or b"{}")
        except ValueError:
            return _error(400, "request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict) or not self.low_latency(request, body):
            return await self.proxy(request, path, content)
        chat = path.endswith("chat/completions")
        if self.to_vllm(request):
            return await self._pd_vllm(request, path, content, body, chat)
        budget = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        prompt_words = len(json.dumps(body.get("messages") or body.get("prompt") or "").split())
        ep = await self._reserve(max(prompt_words, 1))
        if ep is None:
            self.errors.labels("busy").inc()
            if self.when_busy == "fallback":
                return await self.proxy(request, path, content)
            return _error(429, "every decode endpoint is busy", "busy", {"Retry-After": "1"})
        self.requests.labels("low_latency").inc()
        held = _Held(ep)
        try:
            return await self._low_latency(request, path, content, body, chat, budget, held)
        finally:
            if not held.streaming:
                held.end()

    async def _transfer_failed(self, request, path: str, content: bytes, message: str):
        """The KV will not reach the decode endpoint: the regular pool serves the request, or the client gets
        502 at once (never the decode timeout)."""
        self.errors.labels("transfer").inc()
        log.warning("low-latency route failed: %s", message)
        if self.when_failed == "fallback":
            return await self.proxy(request, path, content)
        return _error(502, message, "kv_transfer_error")

    async def _low_latency(self, request, path: str, content: bytes, body: dict, chat: bool, budget: int, held: _Held):
        import httpx
        from starlette.responses import JSONResponse, StreamingResponse

        ep = held.ep
        rid = f"kvx-{uuid.uuid4().hex}"
        start = time.monotonic()
        pre = dict(body, stream=False, max_tokens=1, return_token_ids=True)
        if chat:
            pre["max_completion_tokens"] = 1
        params = dict(pre.get("kv_transfer_params") or {})
        params["kvxfer"] = {"consumer": ep.kvxfer, "request_id": rid}
        if self.digests:
            params["kvxfer"]["digests"] = True
        pre["kv_transfer_params"] = params
        pre.pop("stream_options", None)
        pj, failed = await self._prefill_once(path, pre)
        if failed is not None:
            return failed
        shipped = (pj.get("kv_transfer_params") or {}).get("kvxfer") or {}
        status = shipped.get("status")
        if status not in SHIPPING:
            why = f"status {status!r}: {shipped.get('error') or 'no reason given'}" if status else "no status"
            return await self._transfer_failed(
                request, path, content, f"the KV transfer to {ep.url} did not happen ({why})"
            )
        choice = pj["choices"][0]
        first_id = (choice.get("token_ids") or [None])[0]
        first_text = choice["message"].get("content", "") if chat else choice.get("text", "")
        remaining = budget - 1 if choice.get("finish_reason") == "length" and first_id is not None else 0
        gen = {
            "req": rid,
            "first_token": first_id if first_id is not None else 0,
            "max_tokens": remaining,
            "stream": True,
            "timeout": self.decode_timeout,
            "admit_timeout": self.admit_timeout,
            "sampling": {k: body[k] for k in SAMPLING_KEYS if k in body},
        }
        base = {
            "id": pj.get("id", rid),
            "created": pj.get("created", int(time.time())),
            "model": pj.get("model"),
            "kv_transfer_params": pj.get("kv_transfer_params"),
        }
        resp = None
        if remaining:
            # wait for the decode endpoint to hold the KV before the first byte to the client, so a failed
            # transfer can still fall back or answer with an error status
            try:
                resp = await self.client.send(
                    self.client.build_request(
                        "POST",
                        f"{ep.url}/v1/generate",
                        json=gen,
                        headers=self.pool.headers,
                        timeout=self.decode_timeout,
                    ),
                    stream=True,
                )
            except httpx.HTTPError as e:
                return await self._transfer_failed(request, path, content, f"decode endpoint {ep.url}: {e}")
            if resp.status_code != 200:
                detail = (await resp.aread())[:300].decode(errors="replace")
                await resp.aclose()
                return await self._transfer_failed(
                    request, path, content, f"decode endpoint {ep.url} answered {resp.status_code}: {detail}"
                )
        elif first_id is not None:  # the prefill's answer is all of it; the hand-off only has to be given back
            self._spawn(self._discard(ep, dict(gen, stream=False)))
        self.ttft.labels("low_latency").observe(time.monotonic() - start)

        async def tokens():
            """(text, finish_reason) pieces: the prefill's first token, then the decode endpoint's."""
            yield first_text, None if remaining else (choice.get("finish_reason") or "length")
            if resp is None:
                return
            sent = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("done"):
                    break
                sent += 1
                yield ev["text"], "length" if sent == remaining else None
            if sent < remaining:
                raise RuntimeError(f"decode stream ended after {sent} of {remaining} tokens")

        async def close():
            if resp is not None:
                await resp.aclose()

        if body.get("stream"):

            async def sse():
                first = True
                try:
                    async for text, finish in tokens():
                        yield _chunk(base, chat, text, finish, first)
                        first = False
                except Exception as e:  # end the client's stream with an error event, never hang
                    self.errors.labels("decode").inc()
                    error = {"error": {"message": f"decode failed: {e}", "type": "decode_error"}}
                    yield f"data: {json.dumps(error)}\n\n"
                finally:
                    held.end()
                    await close()
                yield "data: [DONE]\n\n"

            held.streaming = True
            return StreamingResponse(sse(), media_type="text/event-stream")
        pieces, finish = [], "length"
        try:
            async for text, f in tokens():
                pieces.append(text)
                finish = f or finish
        except Exception as e:
            self.errors.labels("decode").inc()
            return _error(502, f"decode failed: {e}", "decode_error")
        finally:
            await close()
        return JSONResponse(_full(base, chat, "".join(pieces), finish, len(pieces), pj.get("usage", {})))

    async def _prefill_once(self, path: str, pre: dict):
        """POST the prefill request: its answer's JSON, or (``None``, the response the client gets) when it failed."""
        import httpx
        from starlette.responses import JSONResponse

        try:
            r = await self.client.post(f"{self.prefill}{path}", json=pre, timeout=self.prefill_timeout)
        except httpx.HTTPError as e:
            self.errors.labels("prefill").inc()
            return None, _error(502, f"prefill unreachable: {e}", "upstream_error")
        if r.status_code != 200:
            self.errors.labels("prefill").inc()
            return None, JSONResponse(_json_or(r), status_code=r.status_code)
        return r.json(), None

    async def _pd_vllm(self, request, path: str, content: bytes, body: dict, chat: bool):
        """Prefill holding the KV, then the client's request to a vLLM decode instance with the prefill's
        ``kv_transfer_params``, its answer passed through as it comes."""
        import httpx
        from starlette.responses import Response, StreamingResponse

        assert self.vllm_pool is not None
        candidates = await self.vllm_pool.up(self.client)
        if not candidates:
            self.errors.labels("busy").inc()
            if self.when_busy == "fallback":
                return await self.proxy(request, path, content)
            return _error(503, "no vLLM decode instance is up", "busy", {"Retry-After": "1"})
        self.requests.labels("vllm_decode").inc()
        start = time.monotonic()
        pre = dict(body, stream=False, max_tokens=1, kv_transfer_params=claim(self.vllm_connector, self.digests))
        if chat:
            pre["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens"):
            pre.pop(key, None)
        pj, failed = await self._prefill_once(path, pre)
        if failed is not None:
            return failed
        choice = pj["choices"][0]
        if choice.get("finish_reason") != "length":  # ended at its first token (EOS, a stop string): all of it
            self.ttft.labels("vllm_decode").observe(time.monotonic() - start)
            return _whole(pj, chat, bool(body.get("stream")))
        why = not_held(self.vllm_connector, pj.get("kv_transfer_params"))
        if why:
            return await self._transfer_failed(request, path, content, why)
        decode = dict(body, kv_transfer_params=pj["kv_transfer_params"])
        for inst in candidates:
            held = _Held(inst)
            try:
                resp = await self.client.send(
                    self.client.build_request("POST", f"{inst.url}{path}", json=decode, timeout=self.decode_timeout),
                    stream=True,
                )
            except httpx.ConnectError as e:  # gone since the last probe: the KV is still held, try the next one
                held.end()
                inst.alive = False
                log.warning("vLLM decode instance %s unreachable: %s", inst.url, e)
                continue
            except httpx.HTTPError as e:
                held.end()
                self.errors.labels("decode").inc()
                return _error(502, f"vLLM decode instance {inst.url}: {type(e).__name__} {e}", "decode_error")
            if resp.status_code != 200:
                self.errors.labels("decode").inc()
                detail = await resp.aread()
                await resp.aclose()
                held.end()
                return Response(detail, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
            return StreamingResponse(
                self._relay(resp, held, start),
                status_code=200,
                headers={k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}},
            )
        self.errors.labels("decode").inc()
        return _error(502, "no vLLM decode instance could be reached", "decode_error")

    async def _relay(self, resp, held: _Held, start: float):
        """The decode instance's answer, byte for byte; TTFT at its first bytes."""
        first = True
        try:
            async for piece in resp.aiter_raw():
                if first and piece:
                    self.ttft.labels("vllm_decode").observe(time.monotonic() - start)
                    first = False
                yield piece
        finally:
            held.end()
            await resp.aclose()

    async def _discard(self, ep: Endpoint, gen: dict) -> None:
        """Claim and give back a hand-off nobody decodes (its blocks would otherwise wait out the endpoint's TTL)."""
        import httpx

        try:
            await self.client.post(
                f"{ep.url}/v1/generate", json=gen, headers=self.pool.headers, timeout=self.decode_timeout
            )
        except httpx.HTTPError as e:
            log.info("giving back %s on %s failed: %s", gen["req"], ep.url, e)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- app --------------------------------------------------------------------------------------------------
    def app(self):
        from contextlib import asynccontextmanager

        from prometheus_client import generate_latest
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        @asynccontextmanager
        async def lifespan(_app):
            pools = [self.pool] + ([self.vllm_pool] if self.vllm_pool else [])
            await asyncio.gather(*(p.refresh(self.client) for p in pools))
            tasks = [asyncio.create_task(p.run(self.client)) for p in pools]
            yield
            for task in tasks:
                task.cancel()
            await self.client.aclose()

        async def completions(request):
            return await self.serve(request, "/v1/completions")

        async def chat(request):
            return await self.serve(request, "/v1/chat/completions")

        async def health(request):
            """Liveness for anyone; the decode pool only for holders of the admin token."""
            if not authorized(request.headers, self.admin_token):
                return JSONResponse({"ok": True})
            pool = {"decode_endpoints": [e.url for e in self.pool.candidates()]}
            if self.vllm_pool is not None:
                pool["vllm_decode_instances"] = [i.url for i in self.vllm_pool.candidates()]
            return JSONResponse({"ok": True, **pool})

        async def metrics(_):
            return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

        async def passthrough(request):
            return await self.proxy(request, request.url.path, await request.body())

        return Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/health", health),
                Route("/metrics", guarded(metrics, self.admin_token)),
                Route("/v1/models", passthrough),
            ],
            lifespan=lifespan,
        )


def _json_or(r) -> dict:
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": r.text[:500], "type": "upstream_error"}}


def _error(status: int, message: str, kind: str, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status, headers=headers
    )


def _whole(pj: dict, chat: bool, stream: bool):
    """A prefill's answer that is the whole answer, in the form the client asked for."""
    from starlette.responses import JSONResponse, StreamingResponse

    if not stream:
        return JSONResponse(pj)
    choice = pj["choices"][0]
    text = (choice["message"].get("content") or "") if chat else choice.get("text", "")
    base = {"id": pj.get("id"), "created": pj.get("created", int(time.time())), "model": pj.get("model")}

    extra = {"token_ids": choice["token_ids"]} if choice.get("token_ids") is not None else None

    async def events():
        yield _chunk(base, chat, text, choice.get("finish_reason") or "stop", True, extra)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _chunk(base: dict, chat: bool, text: str, finish, first: bool, extra: dict | None = None) -> str:
    if chat:
        delta = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    choice.update(extra or {})
    data = {"id": base["id"], "object": obj, "created": base["created"], "model": base["model"], "choices": [choice]}
    if finish and base.get("kv_transfer_params"):
        data["kv_transfer_params"] = base["kv_transfer_params"]
    return f"data: {json.dumps(data)}\n\n"


def _full(base: dict, chat: bool, text: str, finish: str, n: int, usage: dict) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    prompt = int(usage.get("prompt_tokens", 0))
    return {
        "id": base["id"],
        "object": obj,
        "created": base["created"],
        "model": base["model"],
        "choices": [choice],
        "usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n},
        "kv_transfer_params": base.get("kv_transfer_params"),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kvxfer-router", description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="127.0.0.1:8000")
    ap.add_argument("--prefill", required=True, help="URL of vLLM with the KVXferConnector")
    ap.add_argument("--regular", help="URL of the regular pool (default: the prefill URL)")
    ap.add_argument("--decode", action="append", default=[], help="URL of a decode endpoint (repeatable)")
    ap.add_argument(
        "--vllm-decode",
        action="append",
        default=[],
        help="URL of a vLLM decode instance (kv_consumer) that fetches the KV the prefill holds (repeatable)",
    )
    ap.add_argument(
        "--vllm-connector",
        choices=["kvxfer", "nixl"],
        default="kvxfer",
        help="the connector that moves the KV to the vLLM decode pool: the KVXferConnector, or vLLM's NixlConnector",
    )
    ap.add_argument("--etcd", help="host:port of etcd to discover decode endpoints in")
    ap.add_argument("--etcd-prefix", default="/kvxfer/decode/")
    ap.add_argument(
        "--policy",
        choices=["header", "always", "never"],
        default="header",
        help=f"low-latency route: by the {ROUTE_HEADER} header or model alias, always, or never",
    )
    ap.add_argument("--alias", help="a model name that selects the low-latency route")
    ap.add_argument(
        "--when-busy",
        choices=["reject", "fallback"],
        default="reject",
        help="all decode endpoints busy: 429 with Retry-After, or the regular pool",
    )
    ap.add_argument(
        "--when-transfer-fails",
        choices=["error", "fallback"],
        default="error",
        help="the KV transfer failed or was refused: 502 with an error body, or the regular pool",
    )
    ap.add_argument("--prefill-timeout", type=float, default=120.0)
    ap.add_argument("--decode-timeout", type=float, default=60.0)
    ap.add_argument(
        "--admit-timeout",
        type=float,
        default=1.0,
        help="seconds after the prefill answered within which the decode endpoint must have admitted "
        "the KV transfer; later counts as failed",
    )
    ap.add_argument("--digests", action="store_true", help="ask the connector for per-block integrity digests")
    ap.add_argument("--decode-token", help=f"bearer token of the decode endpoints (default: ${DECODE_TOKEN_ENV})")
    ap.add_argument(
        "--admin-token",
        help=f"bearer token for /metrics and the pool in /health (default: ${ROUTER_TOKEN_ENV}; none: open)",
    )
    args = ap.parse_args(argv)
    import uvicorn

    pool = DecodePool(
        args.decode, etcd=args.etcd, prefix=args.etcd_prefix, token=resolve(args.decode_token, DECODE_TOKEN_ENV)
    )
    router = Router(
        args.prefill,
        args.regular,
        pool,
        policy=args.policy,
        alias=args.alias,
        when_busy=args.when_busy,
        when_failed=args.when_transfer_fails,
        prefill_timeout=args.prefill_timeout,
        decode_timeout=args.decode_timeout,
        admit_timeout=args.admit_timeout,
        digests=args.digests,
        admin_token=resolve(args.admin_token, ROUTER_TOKEN_ENV),
        vllm_pool=VLLMDecodePool(args.vllm_decode) if args.vllm_decode else None,
        vllm_connector=args.vllm_connector,
    )
    host, port = args.listen.rsplit(":", 1)
    uvicorn.run(router.app(), host=host, port=int(port), log_level="warning")


if __name__ == "__main__":
    main()
