"""The learning-curve picture written by ``embedcore demo`` / ``train``: matplotlib, an optional extra."""

from __future__ import annotations

__all__ = ["learning_curve", "have_matplotlib"]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def learning_curve(metrics: dict, path: str) -> bool:
    """Draw training loss per step and eval log loss / AUC per epoch beside the optimum; False if no matplotlib.

    Undefined values (``None``, e.g. the AUC of an eval split with one class) are left out of the lines."""
    if not have_matplotlib():
        return False
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def values(xs):
        return np.array([np.nan if x is None else x for x in xs], float)

    def defined(x):
        return x is not None and np.isfinite(x)

    losses = values(metrics["train_loss_per_step"])
    epochs = metrics["epochs"]
    optimum = metrics.get("optimum")
    fig = Figure(figsize=(11, 4.2), dpi=110)  # no pyplot: the caller's backend and figures are left alone
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    if losses.size:
        steps = np.arange(1, losses.size + 1)
        window = max(1, losses.size // 50)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        left.plot(steps, losses, color="#c8d6e5", lw=0.8, label="train log loss (per step)")
        left.plot(steps[window - 1:], smooth, color="#1f5f99", lw=1.8, label=f"train, mean of {window} steps")
    evaluations = metrics.get("evaluations") or [dict(e["eval"], step=e["step"]) for e in epochs]
    ends = [e["step"] for e in evaluations]
    for e in epochs:
        right.axvline(e["step"], color="#999999", lw=0.6, ls=":")
    panels = ((left, "log_loss", "log loss", "Log loss"), (right, "auc", "AUC", "AUC on the eval split"))
    for ax, key, label, title in panels:
        ax.plot(ends, values(e[key] for e in evaluations), "o-", color="#d35400", ms=4, label=f"eval {label}")
        if optimum and defined(optimum[key]):
            ax.axhline(optimum[key], color="#27ae60", ls="--", label=f"teacher optimum {optimum[key]:.4f}")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(metrics.get("title", "embedcore"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return True
