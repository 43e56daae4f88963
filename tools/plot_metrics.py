"""Plot a run's main training curves from its TensorBoard logs into one PNG.

    python tools/plot_metrics.py runs/quickstart_grpo [--out run.png] [--smooth 0.6]
        [--metrics reward_mean,accuracy,eval/*/pass@1,...]

RUN_DIR is a `--log-dir` (or a folder of several: each sub-folder holding event
files is one run, drawn as its own line). Every requested metric that the logs
hold gets a panel; the ones they do not hold are named on stderr. Names may be
glob patterns (`eval/*/pass@1` gives one panel per evaluation set).

A run resumed into the same `--log-dir` writes a new event file; from the step
it restarted at, its points replace the earlier attempt's (a rerun from step 0
replaces the whole curve), so each panel shows the run as it finally went.

--smooth W draws TensorBoard's debiased exponential moving average (weight W,
0 = off) over the raw values, which stay as a faint line.
"""

import argparse
import fnmatch
import math
import os
import sys

DEFAULT_METRICS = ["reward_mean", "accuracy", "eval/*/pass@1", "kl_ref", "kl_old_new", "entropy",
                   "clip_fraction", "grad_norm", "response_length_mean", "mismatch", "step_seconds"]


def find_runs(run_dir: str) -> list[str]:
    """Every folder under run_dir (itself included) that holds TensorBoard event files, sorted."""
    runs = []
    for folder, _, files in os.walk(run_dir):
        if any(name.startswith("events.out.tfevents.") for name in files):
            runs.append(folder)
    return sorted(runs)


def first_event_time(events) -> float:
    try:
        return events.FirstEventTimestamp()
    except ValueError:  # an empty file (a writer that died at once)
        return math.inf


def load_scalars(folder: str) -> dict[str, tuple[list[int], list[float]]]:
    """tag -> (steps, values) of one run folder, every point kept (no reservoir sampling).

    Each event file is one process's writer. A later file replaces an earlier one's
    points from its own first step on: a resumed run continues the curve, a rerun
    from step 0 replaces it (TensorBoard's own reader would keep both and draw a
    zigzag, since torch's writer marks no restarts).
    """
    from tensorboard.backend.event_processing import event_accumulator

    files = []
    for name in os.listdir(folder):
        if name.startswith("events.out.tfevents."):
            events = event_accumulator.EventAccumulator(os.path.join(folder, name),
                                                        size_guidance={event_accumulator.SCALARS: 0})
            events.Reload()
            files.append(events)
    if len(files) > 1:
        print(f"plot_metrics: {folder}: {len(files)} event files, each newer one replacing the older ones "
              "from its first step on", file=sys.stderr)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for events in sorted(files, key=first_event_time):  # oldest writer first
        for tag in events.Tags()["scalars"]:
            points = events.Scalars(tag)
            if not points:
                continue
            steps, values = series.get(tag, ([], []))
            kept = [i for i, step in enumerate(steps) if step < points[0].step]
            series[tag] = ([steps[i] for i in kept] + [p.step for p in points],
                           [values[i] for i in kept] + [p.value for p in points])
    return series


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: exponential moving average, debiased for its zero start."""
    smoothed, last, count = [], 0.0, 0
    for value in values:
        if not math.isfinite(value):
            smoothed.append(value)
            continue
        count += 1
        last = last * weight + (1 - weight) * value
        smoothed.append(last / (1 - weight ** count) if weight < 1 else value)
    return smoothed


def select(patterns: list[str], tags: set[str]) -> tuple[list[str], list[str]]:
    """The tags matching the patterns (in pattern order, sorted within a glob), and patterns matching none."""
    chosen, missing = [], []
    for pattern in patterns:
        matches = sorted(tag for tag in tags if fnmatch.fnmatchcase(tag, pattern))
        if not matches:
            missing.append(pattern)
        chosen += [tag for tag in matches if tag not in chosen]
    return chosen, missing


def plot(runs: dict[str, dict], tags: list[str], out: str, smooth: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    columns = min(3, len(tags))
    rows = math.ceil(len(tags) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.8 * columns, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, tag in zip(axes.flat, tags):
        for index, (name, series) in enumerate(runs.items()):
            if tag not in series:
                continue
            steps, values = series[tag]
            color = colors[index % len(colors)]
            label = name if len(runs) > 1 else None
            marker = "." if len(steps) < 30 else None  # a short run's points stay visible
            if smooth > 0:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                ax.plot(steps, ema(values, smooth), color=color, linewidth=1.6, label=label, marker=marker)
            else:
                ax.plot(steps, values, color=color, linewidth=1.4, label=label, marker=marker)
        ax.set_title(tag, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tags):]:
        ax.axis("off")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a --log-dir, or a folder of several")
    parser.add_argument("--out", help="PNG to write (default: RUN_DIR/metrics.png)")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS),
                        help="comma-separated tags or glob patterns (default: %(default)s)")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1), 0: raw only")
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        print(f"plot_metrics: error: --smooth must be in [0, 1), got {args.smooth}", file=sys.stderr)
        return 2
    folders = find_runs(args.run_dir) if os.path.isdir(args.run_dir) else []
    if not folders:
        print(f"plot_metrics: error: no TensorBoard event files under {args.run_dir}", file=sys.stderr)
        return 2
    runs = {os.path.relpath(folder, args.run_dir): load_scalars(folder) for folder in folders}
    patterns = [name.strip() for name in args.metrics.split(",") if name.strip()]
    tags, missing = select(patterns, set().union(*runs.values()))
    if missing:
        print(f"plot_metrics: not in the logs: {', '.join(missing)}", file=sys.stderr)
    if not tags:
        print(f"plot_metrics: error: none of the requested metrics is in {args.run_dir}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run_dir, "metrics.png")
    plot(runs, tags, out, args.smooth, title=os.path.basename(os.path.abspath(args.run_dir)))
    print(f"wrote {out}: {len(tags)} panels, {len(runs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
