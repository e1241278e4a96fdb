"""`trtllm-bench --plot out.png`: throughput, TTFT and ITL against concurrency, beside HF's.

matplotlib is an optional extra (`pip install 'tensorrt-llm-qwenvl[plot]'`); without it the
plot fails before any benchmark runs, with the extra's name, not after an hour of waves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_EXTRA_HINT = "pip install 'tensorrt-llm-qwenvl[plot]' (or: pip install matplotlib)"

# (row key of ours / served, row key of the HF baseline, axis title)
_PANELS = (
    ("output_tok_s", "output_tok_s", "output tok/s"),
    ("ttft_ms_p50", "ttft_ms", "TTFT p50 (ms)"),
    ("itl_ms_p50", "itl_ms", "ITL p50 (ms)"),
)


def require_matplotlib() -> Any:
    """The pyplot module on a file-only backend, or SystemExit naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}"
        ) from None
    matplotlib.use("Agg")  # no display: the figure only goes to a file
    import matplotlib.pyplot as plt

    return plt


def plot_results(
    path: str | Path,
    series: dict[str, list[dict[str, float]]],
    hf: list[dict[str, float]] | None = None,
) -> Path:
    """One panel per metric; one line per series (e.g. "ours", "served") plus the HF baseline.

    series: name -> rows as the runners return them (keys `concurrency`, `output_tok_s`,
    `ttft_ms_p50`, `itl_ms_p50`). hf: the HF baseline's rows (`ttft_ms`, `itl_ms` are means
    of one batch, so they sit beside our p50s).
    """
    plt = require_matplotlib()
    lines = [(name, rows, 0) for name, rows in series.items() if rows]
    if hf:
        lines.append(("HF transformers", hf, 1))
    if not lines:
        raise ValueError("nothing to plot: no rows")
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(5 * len(_PANELS), 4))
    for ax, panel in zip(axes, _PANELS, strict=True):
        title = panel[2]
        for name, rows, key_index in lines:
            key = panel[key_index]
            points = sorted((r["concurrency"], r[key]) for r in rows if key in r)
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
