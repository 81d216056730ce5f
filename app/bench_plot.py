"""The PNG of `specchat bench`: speedup against plain decoding per configuration
and per prompt category, the device's batch cost curve beside it (matplotlib,
the `bench` extra; the Agg backend, so no display is needed).
"""

from __future__ import annotations

from pathlib import Path


def write_plot(report: dict, path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("the plot needs matplotlib: pip install 'specchat[bench]'") from None
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
