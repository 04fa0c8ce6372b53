"""A picture of a save history (``dckpt history ROOT --plot FILE.png``).

Three panels sharing the step axis: the time each save held up training, the time until
it committed, and the bytes it wrote; one series per tier. Needs matplotlib, the
optional extra ``plot`` (``pip install 'dckpt[plot]'``); drawn with the Agg canvas, so
no display is needed and pyplot's global state is never touched.
"""
from __future__ import annotations

import statistics
from typing import Sequence

from .history import SaveRecord
from ..progress import byte_unit, size_text

# Durable drawn first and larger, so that where a staged copy has its local save's
# values (size, blocking) both stay visible.
_STYLE = {"durable": ("tab:blue", "o", 7), "local": ("tab:orange", "s", 4)}
def _rate(bps: float) -> str:
    return f"{size_text(bps)}/s"


def plot_history(records: Sequence[SaveRecord], path: str, title: str) -> None:
    """Draw ``records`` to the image file ``path`` (its format from the extension:
    .png, .svg, .pdf). Cost: CPU only, about 0.1 s per 10,000 records, plus writing the
    file. Raises ImportError naming ``pip install 'dckpt[plot]'`` when matplotlib is
    missing, ValueError when there is nothing to draw, OSError when the file cannot be
    written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError(f"dckpt history --plot needs matplotlib ({e}): "
                          "pip install 'dckpt[plot]'") from None
    if not records:
        raise ValueError("no save records to plot")
    fig = Figure(figsize=(11, 8.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, explicitly: renders to a file, never to a display
    ax_block, ax_total, ax_size = fig.subplots(3, 1, sharex=True)
    unit, div = byte_unit(max(r.bytes for r in records))
    tiers = [t for t in ("durable", "local") if any(r.tier == t for r in records)]
    tiers += sorted({r.tier for r in records} - set(tiers))  # a newer writer's tier names
    many = len(records) > 300  # thin lines without markers stay readable when dense
    for tier in tiers:
        color, marker, ms = _STYLE.get(tier, ("tab:gray", "^", 5))
        mine = sorted((r for r in records if r.tier == tier), key=lambda r: r.step)
        kw = dict(color=color, marker=None if many else marker, ms=ms, lw=1.0 if many else 1.2)
        # A staged durable copy shares its save call's blocking time: drawn once.
        blocking = [r for r in mine if r.blocking_s is not None and r.mode != "staged"]
        if blocking:
            ax_block.plot([r.step for r in blocking], [r.blocking_s for r in blocking],
                          label=tier, **kw)
        timed = [r for r in mine if r.total_s is not None]
        if timed:
            ax_total.plot([r.step for r in timed], [r.total_s for r in timed], label=tier, **kw)
        ax_size.plot([r.step for r in mine], [r.bytes / div for r in mine], label=tier, **kw)
        recovered = [r for r in mine if r.mode == "recovered"]
        if recovered:  # rebuilt after a crash: no timings, drawn hollow
            ax_size.plot([r.step for r in recovered], [r.bytes / div for r in recovered],
                         ls="none", marker=marker, ms=ms + 3, mfc="none", color=color,
                         label=f"{tier}, recovered (no timings)")
    ax_block.set_ylabel("blocking training (s)")
    ax_total.set_ylabel("call to commit (s)")
    ax_size.set_ylabel(f"written ({unit})")
    ax_size.set_xlabel("step")
    ax_size.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    for ax, what in ((ax_block, "blocking"), (ax_total, "total")):
        if not ax.lines:
            ax.text(0.5, 0.5, f"no {what} times recorded", transform=ax.transAxes,
                    ha="center", va="center", color="gray")
    _epoch_marks(records, (ax_block, ax_total, ax_size))
    for ax in (ax_block, ax_total, ax_size):
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        handles = len(ax.get_legend_handles_labels()[0])
        if handles > 1 or (handles and len(tiers) > 1):
            ax.legend(loc="best", fontsize="small")
    fig.suptitle(f"dckpt save history: {title}\n{_summary(records)}", fontsize="medium")
    fig.savefig(path)


def _summary(records: Sequence[SaveRecord]) -> str:
    steps = [r.step for r in records]
    parts = [f"{len(records)} save(s), steps {min(steps)}-{max(steps)}"]
    for what, vals in (("blocking", [r.blocking_s for r in records if r.blocking_s is not None
                                     and r.mode != "staged"]),
                       ("total", [r.total_s for r in records if r.total_s is not None])):
        if vals:
            parts.append(f"median {what} {statistics.median(vals):.3g} s")
    rates = [r.throughput for r in records if r.throughput]
    if rates:
        parts.append(f"median throughput {_rate(statistics.median(rates))}")
    return ", ".join(parts)


def _epoch_marks(records: Sequence[SaveRecord], axes) -> None:
    """A dotted line at the first save recorded with each new epoch (a record's epoch
    is the last one ended: this is the save at that epoch's end, or the first after
    it); labelled when there are few."""
    marks, last = [], None
    for r in sorted(records, key=lambda r: (r.step, r.time)):
        if r.epoch is not None and r.epoch != last:
            marks.append((r.step, r.epoch))
            last = r.epoch
    if not marks or len(marks) > 60:
        return
    for ax in axes:
        for step, _ in marks:
            ax.axvline(step, color="gray", ls=":", lw=0.8, alpha=0.7)
    if len(marks) <= 20:
        top = axes[0]
        for step, epoch in marks:
            top.annotate(f"epoch {epoch} done", (step, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(2, -2), textcoords="offset points", fontsize="x-small",
                         color="gray", va="top", rotation=90)
