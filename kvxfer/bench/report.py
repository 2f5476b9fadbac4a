"""Presenting rows: a table on stdout, JSON, and a PNG of GB/s against block size (matplotlib, optional)."""

from __future__ import annotations

import json
import math


def _size(n) -> str:
    if n is None:
        return "-"
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _num(v, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def table(rows: list[dict]) -> str:
    """A fixed-width table, one line per row, then notes for rows that failed."""
    latency = any(r.get("kind") == "latency" for r in rows)
    head = ["transport", "mode", "pattern", "block", "total", "descs", "GB/s", "p50 ms", "p99 ms"]
    if latency:
        head += ["req/s", "rtt ms", "p50/rtt", "p99/rtt"]
    head += ["baseline", "base GB/s", "ratio", "paired", "memcpy", "verified"]
    lines = []
    for r in rows:
        cells = [
            r["transport"],
            r["mode"],
            r["pattern"],
            _size(r["block_bytes"]),
            _size(r["total_bytes"]),
            _num(r.get("descriptors"), "d"),
            _num(r.get("gbps"), ".2f"),
            _num(r.get("p50_ms"), ".1f"),
            _num(r.get("p99_ms"), ".1f"),
        ]
        if latency:
            cells += [
                _num(r.get("req_s"), ".0f"),
                _num(r.get("baseline_p50_ms"), ".2f"),
                (_num(r.get("p50_rtt"), ".1f") + "x") if r.get("p50_rtt") else "-",
                (_num(r.get("p99_rtt"), ".1f") + "x") if r.get("p99_rtt") else "-",
            ]
        cells += [
            r.get("baseline") or "-",
            _num(r.get("baseline_gbps"), ".2f"),
            (_num(r.get("ratio"), ".2f") + "x") if r.get("ratio") else "-",
            (_num(r.get("ratio_paired"), ".2f") + "x") if r.get("ratio_paired") else "-",
            _num(r.get("memcpy_gbps"), ".1f"),
            "FAILED" if r.get("error") else ("yes" if r.get("verified") else "NO"),
        ]
        lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines, strict=True)]
    right = {i for i, h in enumerate(head) if h not in ("transport", "mode", "pattern", "baseline", "verified")}

    def fmt(cells):
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines]
    for r in rows:
        where = f"{r['transport']} {r['mode']} {r['pattern']} block {r['block_size']}"
        if r.get("error"):
            out.append(f"! {where}: {r['error']}")
        if r.get("baseline_error"):
            out.append(f"  {where}: no baseline ({r['baseline_error']})")
    return "\n".join(out)


def header(rows: list[dict], geometry_text: str) -> str:
    if not rows:
        return geometry_text
    r = rows[0]
    if r.get("kind") == "latency":
        what = (
            f"latency: {r['requests']} requests of {r['request_blocks']} blocks, {r['concurrency']} in flight; "
            f"p50/p99 from producer submit to {r['latency_clock']}; baseline: the same requests one at a time;\n"
            f"rtt = the baseline's median round trip (one request of the same size sent and acknowledged: a plain "
            f"socket for tcp, raw NIXL for nixl), same run; p50/rtt and p99/rtt: kvxfer's latency in round trips"
        )
    else:
        what = (
            f"{r['tokens']} tokens = {r['blocks']} blocks per transfer; GB/s (1e9 B/s) is the median of "
            f"{r['repeats']} timed transfers after {r['warmup']} warm-up, baselines interleaved"
        )
    return (
        f"{geometry_text}\n{what}\n"
        f"block = bytes of one block in one layer (what one descriptor moves when nothing coalesces); "
        f"descs = descriptors after coalescing;\nratio = GB/s / base GB/s; paired = median over repeats of "
        f"each transfer's ratio to the baseline transfer run right beside it"
    )


def write_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)
        f.write("\n")


def plot_available() -> str | None:
    """None when plotting works, else why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'kvxfer[plot]'"
    return None


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """GB/s against bytes per layer-block, a line per (transport, mode, pattern), baselines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    series: dict[tuple, list] = {}
    refs: dict[tuple, list] = {}
    memcpy: list = []
    for r in rows:
        if r.get("gbps") is None:
            continue
        series.setdefault((r["transport"], r["mode"], r["pattern"]), []).append((r["block_bytes"], r["gbps"]))
        if r.get("baseline_gbps"):
            # a socket baseline moves the same bytes whatever the pattern; a raw NIXL one the same descriptors
            key = (
                (r["transport"], r["baseline"], r["mode"], r["pattern"])
                if r["baseline"] == "nixl-raw"
                else (r["transport"], r["baseline"], "", "")
            )
            refs.setdefault(key, []).append((r["block_bytes"], r["baseline_gbps"]))
        if r.get("memcpy_gbps"):
            memcpy.append((r["block_bytes"], r["memcpy_gbps"]))
    colors: dict[str, str] = {}
    for (transport, mode, pattern), pts in sorted(series.items()):
        pts = sorted(pts)
        color = colors.setdefault(transport, f"C{len(colors)}")
        marker = {"push": "o", "pull": "s"}.get(mode, "^")
        style = {"sequential": "-", "fragmented": "-.", "permuted": ":"}.get(pattern, "-")
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            style,
            marker=marker,
            color=color,
            label=f"kvxfer {transport} {mode} {pattern}",
        )
    for (transport, name, mode, pattern), pts in sorted(refs.items()):
        xs = sorted({p[0] for p in pts})
        ys = [sum(v for x, v in pts if x == k) / sum(1 for x, _ in pts if x == k) for k in xs]
        label = " ".join(x for x in ("baseline", name, mode, pattern) if x)
        ax.plot(xs, ys, "--", color=colors.get(transport, "gray"), alpha=0.6, linewidth=1, label=label)
    if memcpy:
        xs = sorted({p[0] for p in memcpy})
        ys = [max(v for x, v in memcpy if x == k) for k in xs]
        ax.plot(xs, ys, ":", color="gray", label="memcpy (copy limit)")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["block_bytes"] for r in rows})
    ax.set_xticks(ticks)
    ax.set_xticklabels([_size(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("bytes per layer-block (descriptor size when nothing coalesces)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "kvxfer-bench")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
