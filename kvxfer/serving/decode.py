"""The reference decode endpoint: ``kvxfer.runtime`` behind a small HTTP API, with no model.

It admits hand-offs, receives each request's KV into its own paged cache (integrity digests checked by the
consumer when the producer sends them), and streams deterministic tokens derived from the first token and a
checksum of the received KV, so the whole disaggregated path can be tested and demonstrated without a GPU.
A real decode runtime replaces ``generate`` with its model: it takes the same ``Handoff`` (block ids, token
count, first token, sampling) and decodes from the blocks.

HTTP API (Starlette, served by uvicorn); with a token (``--token`` or ``KVXFER_DECODE_TOKEN``) every route but
``/health`` wants ``Authorization: Bearer <token>`` and answers 401 without it:
  GET  /health             200 while serving
  GET  /info               {"kvxfer": address, "transport", "free_blocks", "inflight", "handed", "layers", ...}
  GET  /metrics            Prometheus text (the service's own registry)
  POST /v1/reserve         {"tokens": n} -> 200, or 429 + Retry-After when it could not take n tokens now
  POST /v1/generate        {"req", "first_token", "max_tokens", "stream", "timeout", "admit_timeout"} -> SSE of
                           {"index", "token_id", "text"} events, then {"done": true, "kv": {...}};
                           502 when the transfer failed after admission or its producer's handshake was refused
                           (the producer names the request it opens a session for), 504 when it was not admitted
                           within ``admit_timeout`` seconds (refused, or its producer never reached us) or did
                           not arrive within ``timeout``: the caller learns at once, not after ``timeout``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import zlib

from ..errors import KVXferError, PeerError, TimeoutError
from ..layout import KVLayout
from ..runtime.service import Handoff, ReceiveService
from .auth import DECODE_TOKEN_ENV, guarded, resolve

UNCLAIMED_TTL = 60.0  # seconds a hand-off waits for its /v1/generate before its blocks are released
POLL = 0.05  # seconds between looks at the consumer's ledger while a /v1/generate waits for its KV


def make_cache(layers: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int, dtype: str = "bfloat16"):
    """A paged cache shaped like vLLM's CPU per-layer cache: ``[num_blocks, kv_heads, block_size, 2*head_dim]``."""
    import torch

    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            (num_blocks, kv_heads, block_size, 2 * head_dim), dtype=getattr(torch, dtype)
        )
        for i in range(layers)
    }


class DecodeEndpoint:
    """Hand-offs by request id, waited for by ``generate`` (which may come before or after the KV lands)."""

    def __init__(
        self,
        caches: dict,
        *,
        transport: str = "auto",
        listen: str = "127.0.0.1:0",
        vocab: int = 512,
        max_inflight: int = 16,
        reserve_blocks: int = 0,
        deadline: float = 30.0,
        token_delay: float = 0.0,
        **options,
    ):
        self.caches = caches
        self.layout = KVLayout.from_tensors(caches)
        self.vocab = vocab
        self._cond = threading.Condition()
        self._ready: dict[str, tuple[Handoff, float]] = {}
        self._abandoned: dict[str, float] = {}  # req -> when its caller gave up; a late arrival is released
        self.svc = ReceiveService(
            self.layout,
            transport=transport,
            listen=listen,
            max_inflight=max_inflight,
            reserve_blocks=reserve_blocks,
            deadline=deadline,
            on_ready=self._on_ready,
            **options,
        )
        self.generated = 0
        self.verified = 0
        self.token_delay = token_delay
        self._stop = threading.Event()
        threading.Thread(target=self._expire_loop, daemon=True, name="kvxfer-endpoint-expire").start()

    def _on_ready(self, h: Handoff) -> None:
        with self._cond:
            if h.req not in self._abandoned:
                self._ready[h.req] = (h, time.monotonic())
                self._cond.notify_all()
                return
        self.svc.release(h.req)  # its caller gave up on it: nobody will claim these blocks

    def _expire_loop(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            with self._cond:
                stale = [r for r, (_, t) in self._ready.items() if now - t > UNCLAIMED_TTL]
                for r in stale:
                    del self._ready[r]
                self._abandoned = {r: t for r, t in self._abandoned.items() if now - t <= UNCLAIMED_TTL}
            for r in stale:
                self.svc.release(r)

    def claim(self, req: str, timeout: float, admit_timeout: float | None = None) -> Handoff:
        """Wait for ``req``'s KV. ``PeerError`` as soon as its transfer fails here after admission or its
        producer's handshake is refused;
        ``TimeoutError`` if it is not admitted within ``admit_timeout`` (refused, or no producer reached us) or
        has not arrived within ``timeout``. A request given up on is cancelled and released if it lands later."""
        now = time.monotonic()
        end = now + timeout
        admit_by = now + admit_timeout if admit_timeout is not None else None
        seen, gone = False, 0
        with self._cond:
            while req not in self._ready:
                now = time.monotonic()
                state = self.svc.state(req)
                gone = gone + 1 if seen and state is None else 0
                seen = seen or state is not None
                if state == "failed" or gone >= 2:  # twice: a slot moving between states reads None once
                    error: KVXferError = PeerError(
                        f"the KV transfer of request {req!r} failed here (cancelled, past its deadline, corrupt, "
                        "its producer went away, or this endpoint refused its producer's handshake)"
                    )
                elif not seen and admit_by is not None and now >= admit_by:
                    error = TimeoutError(
                        f"no producer started sending request {req!r} within {admit_timeout}s "
                        "(admission refused, or the transfer failed before reaching us)"
                    )
                elif now >= end:
                    error = TimeoutError(f"KV of request {req!r} did not arrive within {timeout}s")
                else:
                    self._cond.wait(min(end - now, POLL))
                    continue
                self._abandoned[req] = now
                break
            else:
                h = self._ready.pop(req)[0]
                self.verified += h.verified
                return h
        if state == "receiving":
            self.svc.cancel(req, "the decode request waiting for it gave up")
        raise error

    def checksum(self, h: Handoff) -> int:
        """CRC of the received blocks of every layer: the deterministic tokens depend on the KV itself."""
        import torch

        idx = torch.as_tensor(h.block_ids)
        crc = 0
        for t in self.caches.values():
            crc = zlib.crc32(t[idx].contiguous().view(torch.uint8).numpy().tobytes(), crc)
        return crc

    def tokens(self, h: Handoff, first: int, count: int) -> list[int]:
        seed = self.checksum(h)
        out, t = [], int(first)
        for _ in range(count):
            t = (t * 1103515245 + 12345 + seed) % self.vocab
            out.append(t)
        return out

    def can_take(self, tokens: int) -> bool:
        s = self.svc.stats()
        need = -(-max(int(tokens), 1) // self.svc.block_size)
        return s["inflight"] < self.svc.consumer.grants.max_inflight and self.svc.blocks.num_free >= need

    def info(self) -> dict:
        s = self.svc.stats()
        fp = self.layout.fingerprint
        return {
            "kvxfer": self.svc.address,
            "transport": self.svc.transport,
            "free_blocks": self.svc.blocks.num_free,
            "inflight": s["inflight"],
            "handed": s["handed"],
            "completed": s["completed"],
            "failed": s["failed"],
            "rejected": s["rejected"],
            "generated": self.generated,
            "verified": self.verified,
            "layers": fp.num_layers,
            "block_size": fp.block_size,
            "dtype": fp.dtype,
        }

    def close(self) -> None:
        self._stop.set()
        self.svc.close()


def build_app(ep: DecodeEndpoint, token: str = ""):
    """The HTTP API; with ``token`` every route but ``/health`` answers 401 to a request that lacks it."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def health(_):
        return PlainTextResponse("ok")

    async def info(_):
        return JSONResponse(ep.info())

    async def metrics(_):
        return Response(ep.svc.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def reserve(request):
        body = await request.json()
        if ep.can_take(body.get("tokens", 1)):
            return JSONResponse({"ok": True, "kvxfer": ep.svc.address})
        return JSONResponse({"ok": False, "error": "busy"}, status_code=429, headers={"Retry-After": "1"})

    async def generate(request):
        body = await request.json()
        req, first = str(body["req"]), int(body["first_token"])
        count = max(int(body.get("max_tokens", 16)), 0)
        admit = body.get("admit_timeout")
        try:
            h = await asyncio.to_thread(
                ep.claim, req, float(body.get("timeout", 30.0)), None if admit is None else float(admit)
            )
        except KVXferError as e:
            return JSONResponse(
                {"error": {"code": e.code, "message": str(e)}}, status_code=504 if isinstance(e, TimeoutError) else 502
            )
        toks = ep.tokens(h, first, count)
        kv = {
            "blocks": len(h.block_ids),
            "num_tokens": h.num_tokens,
            "bytes": h.nbytes,
            "verified": h.verified,
            "transfer_s": round(h.seconds, 6),
        }

        async def events():
            try:
                for i, t in enumerate(toks):
                    ep.generated += 1
                    yield f"data: {json.dumps({'index': i, 'token_id': t, 'text': f' w{t}'})}\n\n"
                    await asyncio.sleep(ep.token_delay)
                yield f"data: {json.dumps({'done': True, 'kv': kv})}\n\n"
            finally:
                ep.svc.release(req)

        if body.get("stream", True):
            return StreamingResponse(events(), media_type="text/event-stream")
        ep.svc.release(req)
        ep.generated += len(toks)
        return JSONResponse({"token_ids": toks, "text": "".join(f" w{t}" for t in toks), "kv": kv})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/info", guarded(info, token)),
            Route("/metrics", guarded(metrics, token)),
            Route("/v1/reserve", guarded(reserve, token), methods=["POST"]),
            Route("/v1/generate", guarded(generate, token), methods=["POST"]),
        ]
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kvxfer-decode", description="Reference decode endpoint (no model).")
    ap.add_argument("--http", default="127.0.0.1:8200", help="host:port of the HTTP API")
    ap.add_argument("--kvxfer", default="127.0.0.1:0", help="host:port the kvxfer consumer listens on")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-inflight", type=int, default=16)
    ap.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token (a decode step)")
    ap.add_argument("--etcd", help="host:port of etcd to register this endpoint in (lease-bound)")
    ap.add_argument("--etcd-prefix", default="/kvxfer/decode/")
    ap.add_argument("--public-url", help="the HTTP URL the router should use (default http://<--http>)")
    ap.add_argument(
        "--token",
        help=f"bearer token every route but /health wants (default: ${DECODE_TOKEN_ENV}; "
        "none: open to anyone who can reach it)",
    )
    args = ap.parse_args(argv)
    import uvicorn

    caches = make_cache(args.layers, args.kv_heads, args.head_dim, args.block_size, args.num_blocks, args.dtype)
    ep = DecodeEndpoint(
        caches,
        transport=args.transport,
        listen=args.kvxfer,
        vocab=args.vocab,
        max_inflight=args.max_inflight,
        token_delay=args.token_delay,
    )
    host, port = args.http.rsplit(":", 1)
    url = args.public_url or f"http://{args.http}"
    if args.etcd:
        from .discovery import register_forever

        register_forever(args.etcd, args.etcd_prefix, url, ep.info)
    print(json.dumps({"http": url, "kvxfer": ep.svc.address}), flush=True)
    try:
        app = build_app(ep, resolve(args.token, DECODE_TOKEN_ENV))
        uvicorn.run(app, host=host, port=int(port), log_level="warning")
    finally:
        ep.close()


if __name__ == "__main__":
    main()
