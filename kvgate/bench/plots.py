"""PNG plots of a bench run (matplotlib, Agg backend; edge). Times on the axes are simulated seconds."""

from __future__ import annotations

from pathlib import Path

from kvgate.bench.report import RATIO_METRICS, ratios


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(raws: dict[str, list[dict]], speed: float, path: Path) -> None:
    """Turn latency, TTFT and session completion CDFs, one line per arm (its seeds pooled)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for arm, reps in raws.items():
        ok = [r for raw in reps for r in raw["requests"] if r["ok"]]
        series = [sorted((r["end"] - r["start"]) * speed for r in ok),
                  sorted((r["ttft"] - r["start"]) * speed for r in ok if r["ttft"] is not None),
                  sorted((s["end"] - s["start"]) * speed for raw in reps for s in raw["sessions"]
                         if s["ok"] and s["end"])]
        for ax, xs in zip(axes, series):
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=arm)
    for ax, title in zip(axes, ("turn latency", "TTFT", "session completion")):
        ax.set_title(title)
        ax.set_xlabel("seconds (simulated)")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("CDF")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timeseries(raws: dict[str, list[dict]], speed: float, path: Path) -> None:
    """KV usage (mean over engines), running and waiting requests (sum over engines) over time, per arm, for
    the first seed (a time series does not average across workloads)."""
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    seed = None
    for arm, reps in raws.items():
        if not reps:
            continue
        raw = reps[0]
        seed = raw.get("seed")
        by_t: dict[float, list[dict]] = {}
        for s in raw["samples"]:
            by_t.setdefault(round(s["t"], 3), []).append(s)
        ts = sorted(by_t)
        xs = [t * speed for t in ts]
        axes[0].plot(xs, [sum(s["usage"] for s in by_t[t]) / len(by_t[t]) for t in ts], label=arm)
        axes[1].plot(xs, [sum(s["running"] for s in by_t[t]) for t in ts], label=arm)
        axes[2].plot(xs, [sum(s["waiting"] for s in by_t[t]) for t in ts], label=arm)
    for ax, t in zip(axes, ("KV usage (mean over engines)", "running requests", "waiting requests")):
        ax.set_ylabel(t)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since arm start (simulated)" + (f", seed {seed}" if seed is not None else ""))
    axes[0].legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ratio_bars(metrics: dict[str, dict], path: Path) -> None:
    """Per metric, each arm's ratio to direct (left) and to unbounded-kv (right)."""
    plt = _plt()
    bases = [b for b in ("direct", "unbounded-kv") if b in metrics]
    if not bases:
        return
    fig, axes = plt.subplots(1, len(bases), figsize=(8 * len(bases), 5), squeeze=False)
    arms = list(metrics)
    width = 0.8 / max(1, len(arms))
    for ax, base in zip(axes[0], bases):
        r = ratios(metrics, base)
        for j, arm in enumerate(arms):
            ys = [r[arm][k] or float("nan") for k in RATIO_METRICS]
            ax.bar([i + j * width for i in range(len(RATIO_METRICS))], ys, width, label=arm)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")  # ratios span 0.03x..30x
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(RATIO_METRICS))])
        ax.set_xticklabels(RATIO_METRICS, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"ratio to {base}")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(raws: dict[str, list[dict]], metrics: dict[str, dict], speed: float, out_dir: Path) -> list[str]:
    """Write every plot into ``out_dir``; ``raws`` is arm -> one raw record per seed. Returns the file names."""
    latency_cdfs(raws, speed, out_dir / "latency_cdf.png")
    timeseries(raws, speed, out_dir / "kv_timeseries.png")
    ratio_bars(metrics, out_dir / "ratios.png")
    return ["latency_cdf.png", "kv_timeseries.png", "ratios.png"]
