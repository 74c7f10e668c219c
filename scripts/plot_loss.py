"""Plot the training curves of the bundled models from their train_log.jsonl files.

    python scripts/plot_loss.py OUT.png LOG.jsonl [LOG.jsonl ...]
Train loss (thin line) and held-out loss per kind (markers) against tokens seen.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Curve:
    model: str
    tokens_per_step: int = 0
    train: list[tuple[int, float]] = field(default_factory=list)  # (tokens, loss)
    heldout: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def read_curve(path: Path) -> Curve:
    records = [json.loads(line) for line in path.open()]
    cfg = records[0]["config"]
    curve = Curve(records[0]["model"], cfg["batch"] * cfg["seq"])
    for r in records[1:]:
        tokens = (r["step"] + 1) * curve.tokens_per_step
        if "loss" in r:
            curve.train.append((tokens, r["loss"]))
        for kind, loss in r.get("eval", {}).items():
            curve.heldout.setdefault(kind, []).append((tokens, loss))
    return curve


def plot(curves: list[Curve], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    markers = {"file": "o", "chat": "s", "fim": "^"}
    for curve, color in zip(curves, ["tab:blue", "tab:orange", "tab:green"]):
        xs, ys = zip(*curve.train)
        ax.plot([x / 1e6 for x in xs], ys, color=color, lw=0.8, alpha=0.8, label=f"{curve.model} train")
        for kind, points in curve.heldout.items():
            px, py = zip(*points)
            ax.plot([x / 1e6 for x in px], py, color=color, marker=markers.get(kind, "x"), ls="--",
                    lw=0.6, ms=4, label=f"{curve.model} held-out {kind}")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, 4.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("logs", type=Path, nargs="+")
    a = ap.parse_args(argv)
    plot([read_curve(p) for p in a.logs], a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
