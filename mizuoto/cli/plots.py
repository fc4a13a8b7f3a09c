"""`--plot FILE.png`: what `mizuoto bench` and `mizuoto models --plan` print, drawn (matplotlib, the plot extra).

Figures are 800 x 450 pixels (8 x 4.5 in at 100 dpi), written atomically; matplotlib's Agg canvas
is used directly (no pyplot, no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mizuoto.errors import InvalidRequest, MizuotoError

SIZE_IN = (8.0, 4.5)
DPI = 100
INSTALL = "pip install 'mizuoto-runtime[plot]'"


def check_plot_path(path: str | Path) -> None:
    """Before any work: the file is a .png and matplotlib is there."""
    if Path(path).suffix.lower() != ".png":
        raise InvalidRequest(f"--plot {path}: figures are written as PNG; name the file FILE.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MizuotoError(f"--plot needs matplotlib: {INSTALL}") from None


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_IN, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> None:
    from mizuoto.files import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)


def plot_plans(plans: list, refused: list[str], path: str | Path) -> None:
    """Each plan's stages: weights, fixed modules and working memory (MiB), with the plan's peak and budget."""
    mib = float(1 << 20)
    fig = _figure()
    if not plans:
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, "no plan fits:\n" + "\n".join(refused), ha="center", va="center", wrap=True)
        _save(fig, path)
        return
    axes = fig.subplots(len(plans), 1, squeeze=False)[:, 0]
    for ax, plan in zip(axes, plans):
        names = [s.name for s in plan.stages]
        weights = [s.weights / mib for s in plan.stages]
        fixed = [s.fixed / mib for s in plan.stages]
        working = [s.working / mib for s in plan.stages]
        y = list(range(len(names)))
        ax.barh(y, weights, label="weights", color="#4c72b0")
        ax.barh(y, fixed, left=weights, label="fixed", color="#8c8c8c")
        ax.barh(y, working, left=[w + f for w, f in zip(weights, fixed)], label="working", color="#dd8452")
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        top = max([w + f + k for w, f, k in zip(weights, fixed, working)] + [plan.peak / mib])
        ax.axvline(plan.peak / mib, color="black", linestyle="--", label=f"peak {plan.peak / mib:,.0f} MiB")
        if plan.budget / mib <= 2 * top:
            ax.axvline(plan.budget / mib, color="#c44e52", label=f"budget {plan.budget / mib:,.0f} MiB")
            top = max(top, plan.budget / mib)
        ax.set_xlim(0, top * 1.08)
        mode = "streaming" if plan.stream else "non-streaming"
        ax.set_title(f"{plan.model} on {plan.device}, {mode}: {plan.strategy}; peak {plan.peak / mib:,.0f} MiB"
                     f" of {plan.budget / mib:,.0f} MiB", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("MiB")
    fig.tight_layout()
    _save(fig, path)


def plot_bench(result: dict[str, Any], path: str | Path) -> None:
    """Time per second of audio by part (the engine's stages, the contract's whole request) and latencies."""
    fig = _figure()
    left, right = fig.subplots(1, 2)
    parts, values = [], []
    if "lm_ms_per_token" in result:
        tokens, audio = result["tokens"], result["audio_seconds"] or 1.0
        parts += ["LM", "flow", "vocoder"]
        values += [result["lm_ms_per_token"] * tokens / audio, result["flow_ms_per_audio_second"],
                   result["vocoder_ms_per_audio_second"]]
    contract = result.get("contract") or {}
    if "rtf" in contract:
        parts.append("request\n(contract)")
        values.append(1e3 * contract["rtf"])
    left.bar(parts, values, color="#4c72b0")
    left.axhline(1000, color="#c44e52", linestyle="--", label="real time (1000 ms per s)")
    left.set_ylabel("ms per second of audio")
    left.set_title("compute per second of audio", fontsize=9)
    left.legend(fontsize=7)
    names, latencies = [], []
    if "first_chunk_ms" in result:
        names.append("first chunk\n(driver)")
        latencies.append(result["first_chunk_ms"])
    if "first_chunk_ms" in contract:
        names += ["first chunk\n(contract)", "request wall\n(contract)"]
        latencies += [contract["first_chunk_ms"], contract["wall_ms"]]
    if names:
        right.bar(names, latencies, color="#dd8452")
        right.set_ylabel("ms")
        right.set_title("latency (median)", fontsize=9)
    else:
        right.axis("off")
        right.text(0.5, 0.5, "no latency measured\n(--stream times the first chunk)", ha="center", va="center")
    fig.suptitle(f"{result.get('model', '')} on {result.get('device', '')}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
