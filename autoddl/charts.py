"""Charts of predicted breakdowns (matplotlib, headless)."""

from __future__ import annotations

import pandas as pd

SEGMENTS = (("compute_ms", "compute"), ("boxing_fwd_ms", "boxing forward"), ("boxing_bwd_ms", "boxing backward"),
            ("grad_sync_ms", "gradient sync"), ("optimizer_ms", "optimizer"),
            ("step_overhead_ms", "per-step overhead"), ("bubble_ms", "pipeline bubble"))


def breakdown_chart(df: pd.DataFrame, title: str, path: str) -> dict[str, list[float]]:
    """Stacked bars of each applicable scheme's step time, with memory per device on a second axis.
    A segment no scheme has (all zero: the pipeline bubble without stages) is left out. Returns the
    segments drawn: label -> bar heights (ms), in row order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = df[df["applicable"]].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 3, 4.5))
    bottom = pd.Series(0.0, index=rows.index)
    drawn: dict[str, list[float]] = {}
    for column, label in SEGMENTS:
        heights = rows[column].fillna(0.0) if column in rows else None
        if heights is None or not (heights > 0).any():
            continue
        ax.bar(rows["scheme"] + "\n" + rows["mesh"], heights, bottom=bottom, label=label)
        bottom = bottom + heights
        drawn[label] = heights.tolist()
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title)
    mem = ax.twinx()
    mem.plot(range(len(rows)), rows["memory_gb"], "kD", label="memory per device")
    mem.set_ylabel("memory per device (GB)")
    mem.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = mem.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, fontsize=8, loc="upper left", bbox_to_anchor=(1.12, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def gantt_chart(tasks, names, devices: int, title: str, path: str) -> None:
    """Device x time bars of scheduled shard tasks (``start_s``, ``end_s``, ``device``, ``job``,
    ``key``), one colour per job; forwards hatched lighter than backwards, transfers as thin grey bars
    before the task they feed; a spilled shard's host copies as thin bars above its device's row
    (black: the load before a task, purple: the write-back after a backward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(11, 0.7 * devices + 1.8))
    for t in tasks:
        forward = t.key.kind == "F"
        ax.barh(t.device, (t.end_s - t.start_s) * 1e3, left=t.start_s * 1e3, height=0.6,
                color=colours(t.job % colours.N), alpha=0.55 if forward else 1.0, edgecolor="black", linewidth=0.3)
        if t.transfer_s:
            ax.barh(t.device + 0.38, t.transfer_s * 1e3, left=t.start_s * 1e3 - t.transfer_s * 1e3, height=0.12,
                    color="grey")
        if t.load_bytes:
            ax.barh(t.device - 0.42, (t.load_end_s - t.load_start_s) * 1e3, left=t.load_start_s * 1e3, height=0.08,
                    color="black")
        if t.writeback_bytes:
            ax.barh(t.device - 0.34, (t.writeback_end_s - t.writeback_start_s) * 1e3, left=t.writeback_start_s * 1e3,
                    height=0.08, color="purple")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(j % colours.N)) for j in range(len(names))]
    labels = list(names)
    if any(t.load_bytes or t.writeback_bytes for t in tasks):
        handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("black", "purple")]
        labels += ["host -> device (load)", "device -> host (write-back)"]
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              title="job (light: forward)", title_fontsize=8)
    ax.set_yticks(range(devices), [f"device {d}" for d in range(devices)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
