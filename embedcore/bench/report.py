"""The step benchmark's printed tables, summary and chart (matplotlib, optional)."""

from __future__ import annotations

import statistics

__all__ = ["header", "add_summary", "tables", "plot"]


def header(env):
    lines = ["", "machine and settings:"]
    lines.append(f"  {env['cpus']} CPUs ({env.get('cpu_model') or env['machine']}); python {env['python']}, numpy "
                 f"{env['numpy']}, numba {env['numba']} (threading layer {env.get('numba_threading_layer')})")
    lines.append(f"  threads: numba {env['numba_threads']}, torch intra-op {env.get('torch_threads', '-')} / "
                 f"inter-op {env.get('torch_interop_threads', '-')} ({env.get('torch_parallel_backend') or '-'}), "
                 f"OpenBLAS {env['openblas_threads']}, TensorFlow {env.get('tensorflow_threads', '-')}, "
                 f"XLA: {env.get('xla_threads', '-')}")
    lines.append(f"  allocator: {env['allocator']} (LD_PRELOAD={env['LD_PRELOAD'] or '(empty)'}); OMP_WAIT_POLICY="
                 f"{env['OMP_WAIT_POLICY']}; GOMP_SPINCOUNT={env.get('GOMP_SPINCOUNT', '(unset)')}")
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "fbgemm_gpu", "jax", "tensorflow") if k in env)
    lines.append(f"  versions: {versions or '-'}; memory available at start "
                 f"{env['mem_available_gb_at_start'] or float('nan'):.1f} GB, tables budget "
                 f"{env['memory_budget_gb']:.1f} GB")
    return "\n".join(lines)


def _contender_records(result):
    for case in result["cases"]:
        yield case, case["contenders"]
    for points in result["sweeps"].values():
        for case in points:
            yield case, case["contenders"]


def add_summary(result):
    """Fractions of the machine limits, ratios to embedcore, and the run's verdicts; stored in ``result``."""
    copy = result["machine"]["copy_gbps"]
    gather = result["machine"]["gather_gbps"]
    all_ok = True
    failures = []
    for case, recs in _contender_records(result):
        base = recs.get("embedcore", {}).get("median_ms")
        base_rounds = recs.get("embedcore", {}).get("round_medians_ms")
        for name, rec in recs.items():
            if "median_ms" in rec:
                rec["ratio_to_embedcore"] = rec["median_ms"] / base if base else None
                rec["round_ratios"] = _round_ratios(rec.get("round_medians_ms"), base_rounds)
                rec["fraction_of_copy"] = rec["gbps_median"] / copy if copy else None
                rec["fraction_of_gather"] = rec["gbps_median"] / gather if gather else None
            ok = rec.get("check", {}).get("ok", False) and rec.get("final_check", {}).get("ok", False)
            if "error" in rec or not ok:
                all_ok = False
                failures.append(f"{case['label']}: {name}: " + (rec.get("error") or "disagrees with the reference"))
    shares = [s for case, _ in _contender_records(result) for s in case["other_cpu_per_round"] if s is not None]
    first = next((c["contenders"]["embedcore"] for c in result["cases"] if "embedcore" in c["contenders"]), None)
    compile_info = None
    if first is not None:
        info = first.get("info", {})
        compile_info = {k: info.get(k) for k in ("build_s", "first_lookup_s", "first_apply_gradients_s")}
        compile_info["first_step_s"] = first.get("first_step_s")
    jax_donation = sorted({rec.get("info", {}).get("donation") for _, recs in _contender_records(result)
                           for name, rec in recs.items() if name == "jax" and rec.get("info", {}).get("donation")})
    result["summary"] = {
        "all_checks_ok": all_ok, "failures": failures, "copy_gbps": copy, "gather_gbps": gather,
        "other_cpu_share_max": max(shares) if shares else None,
        "other_cpu_share_median": statistics.median(shares) if shares else None,
        "embedcore_first_calls_s": compile_info, "jax_donation": jax_donation,
    }


def _round_ratios(mine, base):
    """The contender's median over embedcore's, round by round (the two ran one after the other, so a slow
    phase of the machine weighs on both), or None when either lacks a round."""
    if not mine or not base or len(mine) != len(base) or not all(base):
        return None
    return [m / b for m, b in zip(mine, base)]


def _fmt_round_ratios(ratios):
    if not ratios:
        return "-"
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def _fmt_pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def _case_table(case):
    lines = []
    w = case["workload"]
    uniq = case["distinct_ids_per_batch"]
    nb = case["bytes_per_batch"]
    mean_rand = statistics.mean(b["random_row_bytes"] for b in nb) / 1e6
    mean_seq = statistics.mean(b["sequential_bytes"] for b in nb) / 1e6
    lines.append(f"{case['label']}")
    lines.append(f"  {w['ids_per_step']:,} ids/step, {min(uniq):,}-{max(uniq):,} distinct; minimal bytes/step "
                 f"{mean_rand:.1f} MB random rows + {mean_seq:.1f} MB sequential; reference {case.get('reference')}")
    head = (f"  {'contender':34s} {'median ms':>10s} {'min-max ms':>17s} {'x embedcore':>11s} {'x per round':>13s} "
            f"{'GB/s':>6s} {'%copy':>6s} {'%gather':>7s}  {'check':s}")
    lines.append(head)
    lines.append("  " + "-" * (len(head) - 2))
    for name, rec in case["contenders"].items():
        label = rec.get("label", name)
        if "median_ms" not in rec:
            lines.append(f"  {label:34s} {'(no timing: ' + rec.get('error', 'failed') + ')'}")
            continue
        check = rec.get("check", {})
        final = rec.get("final_check", {})
        verdict = "ok" if check.get("ok") and final.get("ok") else "FAILED"
        worst = max(v for v in (check.get("outputs") or 0.0, check.get("tables", 0.0), check.get("state", 0.0),
                                final.get("tables", 0.0), final.get("state", 0.0)) if v is not None)
        ratio = rec.get("ratio_to_embedcore")
        lines.append(f"  {label:34s} {rec['median_ms']:10.2f} {rec['min_ms']:8.2f}-{rec['max_ms']:<8.2f} "
                     f"{'-' if ratio is None else f'{ratio:.2f}x':>11s} "
                     f"{_fmt_round_ratios(rec.get('round_ratios')):>13s} {rec['gbps_median']:6.2f} "
                     f"{_fmt_pct(rec.get('fraction_of_copy')):>6s} {_fmt_pct(rec.get('fraction_of_gather')):>7s}  "
                     f"{verdict} ({worst:.0e})")
    for name, why in case["skipped"].items():
        lines.append(f"  {'(' + name + ')':34s} skipped: {why}")
    shares = [s for s in case["other_cpu_per_round"] if s is not None]
    phases = []
    for name, rec in case["contenders"].items():
        ph = rec.get("phases_median_ms")
        if ph and len(ph) > 1:
            phases.append(f"{name}: " + " + ".join(f"{k} {v:.1f}" for k, v in ph.items()))
    if phases:
        lines.append("  phases (median ms): " + "; ".join(phases))
    if shares:
        lines.append(f"  other processes used {', '.join(f'{100 * s:.0f}%' for s in shares)} of the CPUs in the "
                     f"rounds")
    return lines


def _sweep_table(kind, points):
    lines = []
    if not points:
        return lines
    names = []
    for case in points:
        for name in case["contenders"]:
            if name not in names:
                names.append(name)
    x = "rows" if kind == "sweep-rows" else "ids/step"
    w0 = points[0]["workload"]
    fixed = (f"{w0['ids_per_step']:,} ids/step" if kind == "sweep-rows" else f"{w0['E']:,} rows")
    lines.append(f"{kind}: one table, D={w0['D']}, L={w0['L']}, {w0['dist']}(alpha={w0['alpha']}), "
                 f"{w0['optimizer']}, {fixed}; median ms per step (forward + backward + optimizer)")
    head = f"  {x:>12s} {'distinct':>9s} " + " ".join(f"{n:>15s}" for n in names)
    lines.append(head)
    lines.append("  " + "-" * (len(head) - 2))
    for case in points:
        w = case["workload"]
        cells = []
        for n in names:
            rec = case["contenders"].get(n)
            if rec is None:
                cells.append(f"{'(' + ('skipped' if n in case['skipped'] else '-') + ')':>15s}")
            elif "median_ms" not in rec:
                cells.append(f"{'(failed)':>15s}")
            else:
                ok = rec.get("check", {}).get("ok") and rec.get("final_check", {}).get("ok")
                cells.append(f"{rec['median_ms']:14.2f}{' ' if ok else '!'}")
        distinct = int(statistics.median(case["distinct_ids_per_batch"]))
        lines.append(f"  {w['point']:>12,} {distinct:>9,} " + " ".join(cells))
    skipped = sorted({f"{n} at {case['workload']['point']:,}: {why}" for case in points
                      for n, why in case["skipped"].items()})
    for s in skipped:
        lines.append(f"  skipped: {s}")
    return lines


def tables(result):
    lines = ["", "=" * 110,
             "RESULTS (per step; x embedcore = contender median / embedcore median, above 1 = slower than embedcore;",
             "x per round = the lowest and highest of that ratio taken round by round, each contender against the",
             "embedcore steps of the same round: how much the machine's phases moved the ratio;",
             "GB/s = minimal bytes / time; %copy / %gather = that GB/s over the run's streaming-copy / "
             "random-256-byte-row-gather bandwidth;",
             "above 100% of gather means the step's rows were mostly cache hits (hot Zipf rows), not random DRAM rows)",
             "=" * 110]
    m = result["machine"]
    if m["copy_gbps"] and m["gather_gbps"]:
        lines.append(f"machine limits measured in this run: copy {m['copy_gbps']:.2f} GB/s, gather "
                     f"{m['gather_gbps']:.2f} GB/s (256-byte rows from a {m['gather_table_mb']} MiB table)")
    for name, p in m["probes"].items():
        lines.append(f"  {name:34s} median {p['median_gbps']:6.2f} GB/s (min {p['min_gbps']:.2f}, max "
                     f"{p['max_gbps']:.2f}; {p['n']} runs)")
    for case in result["cases"]:
        lines.append("")
        lines += _case_table(case)
    for kind, points in result["sweeps"].items():
        lines.append("")
        lines += _sweep_table(kind, points)
    s = result["summary"]
    lines.append("")
    if s["embedcore_first_calls_s"]:
        f = s["embedcore_first_calls_s"]
        parts = [f"{k} {v:.2f} s" for k, v in f.items() if v is not None]
        lines.append("embedcore first calls (first case; Numba compiles; kernels with cache=True may load from "
                     "disk): " + ", ".join(parts))
    firsts = {}
    for case in result["cases"][:1]:
        for name, rec in case["contenders"].items():
            if rec.get("first_step_s") is not None:
                firsts[name] = rec["first_step_s"]
    if firsts:
        lines.append("first step of each contender (compile / warm-up, first case): " +
                     ", ".join(f"{k} {v:.2f} s" for k, v in firsts.items()))
    if s["jax_donation"]:
        lines.append("JAX buffer donation: " + "; ".join(s["jax_donation"]))
    for name, why in result["skipped_contenders"].items():
        lines.append(f"contender {name} skipped: {why}")
    if s["other_cpu_share_max"] is not None:
        lines.append(f"other processes' CPU share per round: median {100 * s['other_cpu_share_median']:.0f}%, max "
                     f"{100 * s['other_cpu_share_max']:.0f}%")
        if s["other_cpu_share_max"] > 0.10:
            lines.append(f"WARNING: other processes used up to {100 * s['other_cpu_share_max']:.0f}% of the CPUs "
                         f"during the rounds: every figure is pessimistic and noisy; rerun on a quiet machine")
    lines.append("agreement: " + ("every contender matched the reference within tolerance" if s["all_checks_ok"]
                                  else "FAILED: " + "; ".join(s["failures"])))
    lines.append(f"wall time {result['wall_s']:.0f} s, peak RSS {result['peak_rss_gb']:.2f} GB")
    return "\n".join(lines)


def plot(result, path):
    """Four panels: case medians, case %gather, rows sweep, ids sweep. False if matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    import numpy as np

    fig = Figure(figsize=(15, 10), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    cases = result["cases"]
    names = []
    for case in cases:
        for n, rec in case["contenders"].items():
            if "median_ms" in rec and n not in names:
                names.append(n)
    colors = {n: c for n, c in zip(["embedcore", "embedcore-custom", "embedcore-skip", "embedcore-torch", "fbgemm",
                                    "torch", "jax", "tensorflow", "numpy"],
                                   ["#c0392b", "#f5b7b1", "#922b21", "#e67e22", "#2980b9", "#8e44ad", "#27ae60",
                                    "#f1c40f", "#7f8c8d"])}
    labels = [c["label"].split(": ", 1)[0] + ": " + c["workload"]["optimizer"] +
              (" w" if c["workload"]["weighted"] else "") for c in cases]
    width = 0.8 / max(1, len(names))
    for panel, key in ((axes[0][0], "median_ms"), (axes[0][1], "fraction_of_gather")):
        for k, n in enumerate(names):
            ys, lo, hi, xs = [], [], [], []
            for i, case in enumerate(cases):
                rec = case["contenders"].get(n)
                if rec is None or key not in rec or rec[key] is None:
                    continue
                xs.append(i + (k - (len(names) - 1) / 2) * width)
                if key == "median_ms":
                    ys.append(rec["median_ms"])
                    lo.append(rec["median_ms"] - rec["min_ms"])
                    hi.append(rec["max_ms"] - rec["median_ms"])
                else:
                    ys.append(100 * rec[key])
            if not xs:
                continue
            kwargs = {"yerr": [lo, hi], "capsize": 2} if key == "median_ms" else {}
            panel.bar(xs, ys, width, label=n, color=colors.get(n), **kwargs)
        panel.set_xticks(range(len(cases)))
        panel.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        panel.grid(axis="y", alpha=0.3)
        if key == "median_ms":
            panel.set_yscale("log")
            panel.set_ylabel("ms per step (median, min-max)")
            panel.set_title("Step time per case (lower is better)")
            panel.legend(fontsize=8, loc="upper left", ncol=4)
            lo_, hi_ = panel.get_ylim()
            panel.set_ylim(lo_, hi_ * 4)  # room for the legend
        else:
            panel.set_ylabel("% of random-row gather bandwidth")
            g = result["machine"]["gather_gbps"]
            c = result["machine"]["copy_gbps"]
            panel.set_title("Minimal bytes / time vs the machine" +
                            (f" (gather {g:.1f} GB/s, copy {c:.1f} GB/s)" if g and c else ""))
    for panel, kind, xlabel in ((axes[1][0], "sweep-rows", "vocabulary rows"),
                                (axes[1][1], "sweep-ids", "ids per step")):
        points = result["sweeps"].get(kind) or []
        series = {}
        for case in points:
            for n, rec in case["contenders"].items():
                if "median_ms" in rec:
                    series.setdefault(n, []).append((case["workload"]["point"], rec["median_ms"], rec["min_ms"],
                                                     rec["max_ms"]))
        for n, pts in series.items():
            pts.sort()
            x = np.array([p[0] for p in pts], float)
            y = np.array([p[1] for p in pts])
            panel.errorbar(x, y, yerr=[y - np.array([p[2] for p in pts]), np.array([p[3] for p in pts]) - y],
                           marker="o", capsize=2, label=n, color=colors.get(n))
        panel.set_xscale("log")
        panel.set_yscale("log")
        panel.set_xlabel(xlabel)
        panel.set_ylabel("ms per step")
        if points:
            w0 = points[0]["workload"]
            fixed = (f"{w0['ids_per_step']:,} ids/step" if kind == "sweep-rows" else f"{w0['E']:,} rows")
            panel.set_title(f"{kind}: D={w0['D']}, {w0['optimizer']}, {fixed}")
            if series:
                panel.legend(fontsize=8)
        else:
            panel.set_title(f"{kind}: not run")
        panel.grid(alpha=0.3, which="both")
    env = result["env"]
    share = result["summary"]["other_cpu_share_max"]
    fig.suptitle(f"embedcore bench: {env['cpus']} CPUs, {env['threads_requested']} threads, {env['allocator']}; "
                 f"other processes' CPU share max {'?' if share is None else f'{100 * share:.0f}%'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return True
