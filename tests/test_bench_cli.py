"""kvxfer-bench: the CLI end to end in two real processes (tiny geometry), and its verification.

The end-to-end runs use a 2-layer cache of 4 KiB layer-blocks so each takes about a second; the point is
that rows come out right and that a wrong byte at the destination fails the run, not the numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvxfer.bench import cli, content, models, patterns, report
from kvxfer.bench.driver import _waves
from kvxfer.channel import SPIN

TINY = [
    "--model",
    "custom",
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "32",
    "--block-size",
    "16",
    "--tokens",
    "512",
    "--repeats",
    "2",
    "--warmup",
    "1",
    "--quiet",
]
REQUIRED = {
    "transport",
    "mode",
    "pattern",
    "block_bytes",
    "gbps",
    "baseline",
    "baseline_gbps",
    "ratio",
    "p50_ms",
    "p99_ms",
    "descriptors",
    "total_bytes",
    "memcpy_gbps",
    "verified",
    "ratio_paired",
}


def run_cli(tmp_path, *extra):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.bench.cli", *TINY, "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = json.loads(out.read_text()) if out.exists() else None
    return proc, rows


# ---- end to end ------------------------------------------------------------------------------------------
def test_cli_two_processes_rows_and_exit_code(tmp_path):
    proc, rows = run_cli(tmp_path, "--mode", "push,pull", "--pattern", "all")
    assert proc.returncode == 0, proc.stderr
    assert len(rows) == 6
    assert {(r["mode"], r["pattern"]) for r in rows} == {(m, p) for m in ("push", "pull") for p in patterns.PATTERNS}
    for r in rows:
        assert set(r) >= REQUIRED, REQUIRED - set(r)
        assert r["transport"] == "tcp" and r["baseline"] == "socket"
        assert r["verified"] is True and r["error"] is None
        assert r["block_bytes"] == 2 * 16 * 64 * 2  # heads x tokens x (K+V) x bf16
        assert r["total_bytes"] == 32 * 2 * r["block_bytes"]  # 512 tokens = 32 blocks, 2 layers
        assert r["verified_bytes"] == (r["repeats"] + r["warmup"]) * r["total_bytes"]
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["memcpy_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"])
        assert r["ratio_paired"] > 0 and len(r["samples_gbps"]) == len(r["baseline_samples_gbps"]) == 2
        assert 0 < r["p50_ms"] <= r["p99_ms"]
    desc = {(r["mode"], r["pattern"]): r["descriptors"] for r in rows}
    assert desc[("push", "sequential")] == 2  # one run per layer region
    assert desc[("push", "fragmented")] == 64  # nothing adjacent: one per layer-block
    assert "transport  mode" in proc.stdout and "socket" in proc.stdout


def test_cli_fails_on_a_corrupted_destination(tmp_path):
    proc, rows = run_cli(tmp_path, "--inject-corruption")
    assert proc.returncode == 1
    assert rows[0]["verified"] is False
    assert "wrong bytes" in rows[0]["error"]
    assert "FAILED" in proc.stdout


@pytest.mark.parametrize("spin", [None, "0"])
def test_cli_latency_mode(tmp_path, spin):
    extra = () if spin is None else ("--spin", spin)
    proc, rows = run_cli(
        tmp_path, "--latency", "--requests", "24", "--concurrency", "4", "--request-blocks", "1-4", *extra
    )
    assert proc.returncode == 0, proc.stderr
    (r,) = rows
    assert r["spin"] == (SPIN if spin is None else 0.0)
    assert r["kind"] == "latency" and r["requests"] == 24 and r["concurrency"] == 4
    assert r["req_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["latency_clock"] == "consumer arrival"  # both halves on this machine share the clock
    assert r["verified"] and r["baseline_p50_ms"] > 0
    assert r["p50_rtt"] == pytest.approx(r["p50_ms"] / r["baseline_p50_ms"])  # latency in same-run round trips
    assert r["p99_rtt"] >= r["p50_rtt"] > 0
    assert "p50/rtt" in proc.stdout and "rtt = the baseline's median round trip" in proc.stdout


def test_cli_tls_rows_beside_plain_tcp(tmp_path):
    proc, rows = run_cli(tmp_path, "--transport", "tcp,tcp+tls", "--mode", "push,pull")
    assert proc.returncode == 0, proc.stderr
    assert [(r["transport"], r["mode"]) for r in rows] == [
        ("tcp", "push"),
        ("tcp", "pull"),
        ("tcp+tls", "push"),
        ("tcp+tls", "pull"),
    ]
    assert all(r["verified"] and r["error"] is None and r["baseline"] == "socket" for r in rows)
    with pytest.raises(SystemExit) as e:  # TLS covers tcp only
        cli.main(["--transport", "nixl+tls", "--quiet"])
    assert e.value.code == 2


def test_cli_usage_errors():
    with pytest.raises(SystemExit) as e:
        cli.main(["--transport", "no-such-transport", "--quiet"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["--role", "producer", "--quiet"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["--pattern", "diagonal"])
    assert e.value.code == 2
    for spin in ("-1", "1", "nan"):
        with pytest.raises(SystemExit) as e:
            cli.main(["--spin", spin, "--quiet"])
        assert e.value.code == 2


def test_transport_all_is_what_is_available():
    from kvxfer import transports

    assert cli.resolve_transports(["all"]) == transports.available()
    assert cli.resolve_transports(["tcp", "tcp"]) == ["tcp"]


# ---- verification ----------------------------------------------------------------------------------------
def _pair(layers=3, blocks=10, geom=None):
    geom = geom or models.Geometry("t", layers=layers, kv_heads=2, head_dim=8)
    src = models.allocate(geom, blocks)
    dst = models.allocate(geom, blocks)
    c = content.Content(7, geom.layers, blocks, geom.layer_block_bytes)
    c.fill(src)
    content.poison(dst)
    return geom, c, src, dst


def _copy(src, dst, s_ids, d_ids):
    for a, b in zip(src, dst, strict=True):
        b[d_ids] = a[s_ids]


def test_verify_accepts_exact_bytes():
    _, c, src, dst = _pair()
    s_ids, d_ids = np.array([3, 1, 4, 5]), np.array([0, 9, 2, 6])
    _copy(src, dst, s_ids, d_ids)
    rep = c.verify(dst, d_ids, s_ids)
    assert rep.ok and rep.checked_bytes == 3 * 4 * src[0][0].nbytes


@pytest.mark.parametrize("damage", ["flip", "swap", "missing", "wrong-layer"])
def test_verify_catches_every_kind_of_wrong(damage):
    _, c, src, dst = _pair()
    s_ids, d_ids = np.array([3, 1, 4, 5]), np.array([0, 9, 2, 6])
    _copy(src, dst, s_ids, d_ids)
    if damage == "flip":
        content._rows(dst[2])[6, 17] ^= 1
    elif damage == "swap":
        for a in dst:
            a[[0, 9]] = a[[9, 0]]
    elif damage == "missing":
        content.poison(dst, [2])
    else:
        dst[0][0] = src[1][3]
    rep = c.verify(dst, d_ids, s_ids)
    assert not rep.ok and rep.bad_blocks >= 1
    assert "wrong" in rep.describe()


def test_content_is_deterministic_and_distinct_per_layer_block():
    geom, _, src, _ = _pair(layers=2, blocks=6)
    again = models.allocate(geom, 6)
    content.Content(7, 2, 6, geom.layer_block_bytes).fill(again)
    assert all(np.array_equal(a, b) for a, b in zip(src, again, strict=True))
    rows = np.concatenate([content._rows(a) for a in src])
    assert len({r.tobytes() for r in rows}) == len(rows)


# ---- patterns, waves, table ------------------------------------------------------------------------------
def test_patterns_and_allocator():
    rng = np.random.default_rng(0)
    free = np.arange(100)
    assert (np.diff(patterns.pick("sequential", free, 10, rng)) == 1).all()
    assert (np.diff(patterns.pick("fragmented", free, 10, rng)) == 2).all()
    perm = patterns.pick("permuted", free, 50, rng)
    assert len(set(perm.tolist())) == 50 and not (np.diff(perm) == 1).all()
    alloc = patterns.PatternAllocator(8, "sequential")
    a = alloc.allocate(3)
    assert a.tolist() == [0, 1, 2] and alloc.allocate(6) is None
    alloc.free(a)
    assert alloc.num_free == 8
    with pytest.raises(RuntimeError):
        alloc.free(a)


def test_waves_fit_capacity():
    reqs = [(f"r{i}", np.arange(n)) for i, n in enumerate([5, 5, 5, 16, 1])]
    waves = _waves(reqs, 16)
    assert [len(w) for w in waves] == [3, 1, 1]
    assert all(sum(len(x[1]) for x in w) <= 16 for w in waves)


def test_presets_match_the_models():
    g = models.PRESETS["llama-3-8b"]
    assert g.block_bytes * g.blocks_for(4096) == 512 << 20  # 0.54 GB for a 4k-token prompt
    assert models.PRESETS["llama-3-70b"].layer_block_bytes == 8 << 10  # one KV head per TP-8 shard
    assert models.PRESETS["deepseek-v3"].layer_block_bytes == 16 * 576 * 2


def test_table_renders_missing_values():
    row = {
        "transport": "tcp",
        "mode": "push",
        "pattern": "sequential",
        "block_bytes": 65536,
        "block_size": 16,
        "total_bytes": 512 << 20,
        "descriptors": None,
        "gbps": None,
        "p50_ms": None,
        "p99_ms": None,
        "baseline": None,
        "baseline_gbps": None,
        "ratio": None,
        "memcpy_gbps": 9.0,
        "verified": False,
        "error": "PeerError: gone",
    }
    text = report.table([row])
    assert "FAILED" in text and "PeerError: gone" in text and "512 MiB" in text
