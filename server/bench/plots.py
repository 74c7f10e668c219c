"""PNG plots of benchmark results (matplotlib, the optional extra `spruce[bench]`).

- decode_tps.png: decode tok/s per engine per prompt class (grouped bars).
- itl.png: the inter-token latency distribution per engine, one panel per class (empirical CDF, log x).
"""

from __future__ import annotations

from pathlib import Path

from server.bench.records import EngineResult


class PlotsUnavailable(Exception):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable("matplotlib is not installed (pip install 'spruce[bench]'); no plots drawn") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _plain_log_axis(ax, lo: float, hi: float) -> None:
    """Log scale with plain numbers on the major ticks (1-2-5 steps over a short range, decades over a
    long one) and none on the minor ones (they collide)."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    decades = math.log10(hi / lo) if lo > 0 and hi > lo else 0.0
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def draw_plots(results: list[EngineResult], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    # Engines that produced no numbers (skipped, or every request failed) get no bar and no line.
    ran = [r for r in results if not r.skipped and any(c.runs for c in r.classes)]
    colors = {r.label: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(ran)}  # one colour per engine
    classes = [c for c in _class_order(ran) if any(_decode(r, c) for r in ran)]
    paths = []
    if classes:
        paths.append(_decode_bars(plt, ran, classes, colors, out_dir / "decode_tps.png"))
    itl_classes = [c for c in classes if any(r.class_gaps(c) for r in ran)]
    if itl_classes:
        paths.append(_itl_cdf(plt, ran, itl_classes, colors, out_dir / "itl.png"))
    return paths


def _decode(r: EngineResult, cls: str) -> float | None:
    row = r.summary(cls)
    return row.decode_tps if row else None


def _class_order(results: list[EngineResult]) -> list[str]:
    seen: list[str] = []
    for r in results:
        seen += [c.cls for c in r.classes if c.cls not in seen]
    return seen


def _decode_bars(plt, results: list[EngineResult], classes: list[str], colors: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(classes) * max(1, len(results)) ** 0.5 + 3), 4.0))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        values = [_decode(r, c) or 0.0 for c in classes]
        xs = [k + (i - (len(results) - 1) / 2) * width for k in range(len(classes))]
        ax.bar(xs, values, width, label=r.label, color=colors[r.label])
    ax.set_xticks(range(len(classes)), classes)
    ax.set_ylabel("decode tok/s (client, median)")
    ax.set_title("Decode speed per prompt class")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _itl_cdf(plt, results: list[EngineResult], classes: list[str], colors: dict, path: Path) -> Path:
    cols = min(3, len(classes))
    rows = (len(classes) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, cls in zip(axes.flat, classes):
        lo, hi = float("inf"), 0.0
        for r in results:
            gaps = sorted(g for g in r.class_gaps(cls) if g > 0)
            if gaps:
                ax.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post", label=r.label,
                        color=colors[r.label])
                lo, hi = min(lo, gaps[0]), max(hi, gaps[-1])
        _plain_log_axis(ax, lo, hi)
        ax.set_title(cls, fontsize=10)
        ax.set_xlabel("inter-token latency, ms (log)")
        ax.set_ylabel("share of gaps <= x")
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(classes):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Inter-token latency distribution (dotted line: p99)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
