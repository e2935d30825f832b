"""The compression frontier: final eval loss against payload bytes per worker, one point per
method, from the JSON of `benchmarks.sim.quality` (its `summary`).

Each point is a row's mean over its seeds, the bar its min..max; the shaded band is
DiLoCo fp32's mean up to 2% above it (the quality target), the dotted verticals 1,000x and
3,000x fewer bytes than DDP. Filled markers have error feedback, open ones do not; a
row more than 25% above DiLoCo fp32 is a triangle on the top edge with its loss written.

    python -m benchmarks.sim.frontier_plot runs/bench/frontier.json \
        --out docs/img/compression-frontier.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REFERENCE = "diloco-fp32"
BAND = 0.02
RATIOS = (1000.0, 3000.0)
OFF_SCALE = 0.25  # rows this far above DiLoCo fp32 are drawn on the top edge


def _color(key: str) -> str:
    if key == "ddp":
        return "black"
    if key == REFERENCE:
        return "tab:blue"
    for part, color in (("-rand", "tab:purple"), ("-top", "tab:olive"), ("sign1", "tab:brown"),
                        ("int2", "tab:red"), ("int4", "tab:orange"), ("fp4", "tab:pink"),
                        ("fp32", "tab:green")):
        if part in key:
            return color
    return "gray"


def ddp_bytes(summary: dict[str, dict[str, Any]]) -> float | None:
    """DDP's bytes per worker: the ratio every row carries times its own bytes."""
    for s in summary.values():
        if "ratio_vs_ddp" in s:
            return float(s["ratio_vs_ddp"] * s["bytes_sent_per_worker"])
    return None


def plot(summary: dict[str, dict[str, Any]], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not summary:
        raise SystemExit("frontier_plot: the summary has no rows")
    fig, ax = plt.subplots(figsize=(9, 5.2))
    if REFERENCE in summary:
        ref = summary[REFERENCE]["mean"]
        ax.axhspan(ref, ref * (1 + BAND), color="tab:blue", alpha=0.12, lw=0,
                   label="DiLoCo fp32 mean .. +2%")
        ax.axhline(ref, color="tab:blue", lw=0.6)
    ddp = ddp_bytes(summary)
    if ddp is not None:
        for ratio in RATIOS:
            ax.axvline(ddp / ratio, color="gray", ls=":", lw=1)
            ax.text(ddp / ratio, 1.0, f" {ratio:,.0f}x", transform=ax.get_xaxis_transform(),
                    fontsize=7, color="gray", va="top")
    # Rows far above the rest (a diverged run) sit on the top edge, their loss written out,
    # so that the frontier itself keeps a readable scale.
    means = sorted(s["mean"] for s in summary.values())
    ceiling = (summary[REFERENCE]["mean"] if REFERENCE in summary else means[0]) * (1 + OFF_SCALE)
    shown = [s for s in summary.values() if max(s["losses"]) <= ceiling]
    top = max([max(s["losses"]) for s in shown] + [ceiling / (1 + OFF_SCALE) * (1 + BAND)])
    bottom = min(min(s["losses"]) for s in shown) if shown else means[0]
    pad = (top - bottom) * 0.12 or 0.01
    ax.set_ylim(bottom - pad, top + 2 * pad)
    off = 0
    for key, s in summary.items():
        x, y = s["bytes_sent_per_worker"], s["mean"]
        lo, hi = min(s["losses"]), max(s["losses"])
        color = _color(key)
        ef = "-ef" in key or key in ("ddp", REFERENCE)
        seeds = len(s["losses"])
        text = f"{s['label']} ({seeds} seed{'s' if seeds > 1 else ''})"
        if hi > ceiling:
            ax.plot([x], [top + 1.5 * pad], "^", color=color, ms=7,
                    mfc=color if ef else "white")
            ax.annotate(f"{text}: {y:.2f}, off the scale", (x, top + 1.5 * pad),
                        textcoords="offset points", xytext=(6, -10 - 9 * off), fontsize=6.5,
                        color=color)
            off += 1
            continue
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", color=color, ms=6,
                    mfc=color if ef else "white", capsize=3, lw=1)
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(6, 3), fontsize=6.5,
                    color=color)
    xs = [s["bytes_sent_per_worker"] for s in summary.values()]
    lo_x = min(xs + ([ddp / RATIOS[-1]] if ddp is not None else []))
    ax.set_xlim(lo_x / 1.5, max(xs) * 4)  # room for the labels right of the points
    ax.set(xscale="log", xlabel="payload bytes sent per worker (log)",
           ylabel="final eval loss, outer weights (nats/byte)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(title or "compression frontier: loss against bytes at equal tokens", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="the --json of benchmarks.sim.quality")
    ap.add_argument("--out", type=Path, default=Path("docs/img/compression-frontier.png"))
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        doc = json.loads(args.json.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"frontier_plot: cannot read {args.json}: {e}") from None
    if "summary" not in doc:
        raise SystemExit(f"frontier_plot: {args.json} has no summary (run the benchmark to "
                         "its end, or with --no-run)")
    plot(doc["summary"], args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
