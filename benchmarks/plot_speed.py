"""The speed plot: decode step time against context, per cache, from bench_generate.py's records.

    python benchmarks/plot_speed.py                                   # every benchmarks/results/generate_<gpu>.json
    python benchmarks/plot_speed.py benchmarks/results/generate_h200.json

Writes `generate_<gpu>.png` next to each record: one panel per batch size (and per model where the rows name one),
one line per cache (compiled or eager), the median step time in ms on log axes. Rows that ran out of memory or were
skipped are marked with an x at the panel's top edge. Where several rows measure the same (model, batch, context,
cache, compiled), e.g. rows of several `run`s, the last one in the record is drawn: a record lists its rows in the
order they were measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker as ticker  # noqa: E402
import matplotlib.transforms as transforms  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def cache_label(row: dict) -> str:
    return f"{row['cache']} (compiled)" if row.get("compiled") else row["cache"]


def latest_rows(rows: list[dict]) -> dict[tuple, dict]:
    """The last row per (model, batch, context, cache label)."""
    return {(row.get("model"), row["batch"], row["context"], cache_label(row)): row for row in rows}


def plot_record(path: Path) -> Path:
    record = json.loads(path.read_text())
    rows = latest_rows(record["rows"])
    panels = sorted({(model or "", batch) for model, batch, _, _ in rows})
    labels = sorted({label for *_, label in rows})
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    for ax, panel in zip(axes[0], panels):
        model, batch = panel
        edge = transforms.blended_transform_factory(ax.transData, ax.transAxes)
        for color, label in enumerate(labels):
            mine = [(key[2], row) for key, row in rows.items() if (key[0] or "", key[1], key[3]) == (*panel, label)]
            here = sorted(mine, key=lambda item: item[0])
            timed = [(context, row["step_ms"]) for context, row in here if row.get("step_ms") is not None]
            failed = [context for context, row in here if row.get("step_ms") is None]
            if timed:
                ax.plot(*zip(*timed), marker="o", color=f"C{color}", label=label)
            if failed:
                top = [0.97] * len(failed)
                failure = f"{label}: out of memory or skipped"
                ax.scatter(failed, top, marker="x", color=f"C{color}", transform=edge, clip_on=False, label=failure)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title(f"{model + ', ' if model else ''}batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(f"model.generate decode step, {record.get('device', path.stem)}")
    figure.tight_layout()
    out = path.with_suffix(".png")
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="*", type=Path, help="generate_<gpu>.json records (default: all of them)")
    args = parser.parse_args()
    for path in args.records or sorted(RESULTS.glob("generate_*.json")):
        print(plot_record(path))


if __name__ == "__main__":
    main()
