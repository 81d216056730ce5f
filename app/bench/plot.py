"""The PNG of `specchat bench`: speedup against plain decoding per configuration
and per prompt category, the device's batch cost curve beside it (matplotlib,
the `bench` extra; the Agg backend, so no display is needed).
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("the plot needs matplotlib: pip install 'specchat[bench]'") from None
    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plot(report: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = [r for r in report["results"] if r["strategy"] != "ar"] or report["results"]
    categories = sorted({c for r in rows for c in r["speedup_by_category"]})
    fig, (ax, ax_cost) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / (len(categories) + 1)
    xs = range(len(rows))
    for j, cat in enumerate(["all", *categories]):
        values = [r["speedup"] if cat == "all" else r["speedup_by_category"].get(cat, 0.0) for r in rows]
        ax.bar([x + j * width for x in xs], values, width, label=cat)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * len(categories) / 2 for x in xs])
    ax.set_xticklabels([r["label"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("speedup vs ar (same run)")
    ax.set_title(f"{Path(report['target']).name}: speedup by strategy and prompt category")
    ax.legend(fontsize=8)
    curve = report.get("batch_cost")
    if curve:
        ks = range(1, len(curve) + 1)
        ax_cost.plot(ks, curve, marker=".", label="T(k)/T(1)")
        ax_cost.plot(ks, list(ks), linestyle="--", color="grey", label="linear")
        ax_cost.set_xlabel("tokens in one batch (k)")
        ax_cost.set_ylabel("cost relative to one token")
        ax_cost.set_title("batch cost on this device")
        ax_cost.legend(fontsize=8)
    else:
        ax_cost.axis("off")
    return _save(plt, fig, path)


def write_load_plot(report: dict, path: Path) -> Path:
    """`bench --clients`: aggregate tokens per second and p50 time to first token against the client count."""
    plt = _pyplot()
    fig, (ax, ax_ttft) = plt.subplots(1, 2, figsize=(12, 5))
    labels = list(dict.fromkeys(r["label"] for r in report["load"]))
    for label in labels:
        rows = sorted((r for r in report["load"] if r["label"] == label), key=lambda r: r["clients"])
        xs = [r["clients"] for r in rows]
        ax.plot(xs, [r["aggregate_tokens_per_second"] for r in rows], marker="o", label=label)
        ax_ttft.plot(xs, [r["ttft_p50"] for r in rows], marker="o", label=label)
    ax.set_xlabel("clients at once")
    ax.set_ylabel("tokens per second, all clients")
    ax.set_title(f"{Path(report['target']).name}: throughput under load")
    ax.legend(fontsize=8)
    ax_ttft.set_xlabel("clients at once")
    ax_ttft.set_ylabel("time to first token, p50 (s)")
    ax_ttft.set_title("latency")
    return _save(plt, fig, path)
