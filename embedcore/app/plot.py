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
    left.plot(ends, values(e["log_loss"] for e in evaluations), "o-", color="#d35400", ms=4, label="eval log loss")
    if optimum and defined(optimum["log_loss"]):
        left.axhline(optimum["log_loss"], color="#27ae60", ls="--", label=f"teacher optimum {optimum['log_loss']:.4f}")
    left.set_xlabel("step")
    left.set_ylabel("log loss")
    left.set_title("Log loss")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.plot(ends, values(e["auc"] for e in evaluations), "o-", color="#d35400", ms=4, label="eval AUC")
    for e in epochs:
        right.axvline(e["step"], color="#999999", lw=0.6, ls=":")
    if optimum and defined(optimum["auc"]):
        right.axhline(optimum["auc"], color="#27ae60", ls="--", label=f"teacher optimum {optimum['auc']:.4f}")
    right.set_xlabel("step")
    right.set_ylabel("AUC")
    right.set_title("AUC on the eval split")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(metrics.get("title", "embedcore"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return True
