"""report.md and plots of an analysed experiment (the dict `analysis.analyse` returns)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..diagnostics.stats import moving_average
from ..runs.metrics_log import read_metrics, series
from ..utils.io import atomic_write, atomic_write_text
from .claims import CLAIM_KINDS
from .inference import min_seeds, minimum_detectable_ratio
from .runner import run_dir
from .spec import Experiment
from .speedup import bound_of


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return v
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if math.isinf(v):
            return "never" if v > 0 else "-inf"
        return f"{v:.{digits}g}"
    return str(v)


def _interval(c: dict[str, Any]) -> str:
    lo, hi = _num(c.get("ci_low")), _num(c.get("ci_high"))
    if math.isfinite(lo) and math.isfinite(hi):
        return f"{_f(lo)}-{_f(hi)}"
    if math.isfinite(lo) != math.isfinite(hi):  # a one-sided bound (censored seeds): never a two-sided interval
        return f">= {_f(lo)}" if math.isfinite(lo) else f"<= {_f(hi)}"
    return "no interval"


def _pct(v: float) -> str:
    return f"{100 * v:+.1f}%" if math.isfinite(v) else "-"


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _what(c: dict[str, Any], rep: dict[str, Any]) -> str:
    return CLAIM_KINDS.choose(c["kind"]).label(c, c.get("versus", rep["baseline"]))


def _verdict(c: dict[str, Any]) -> str:
    """The verdict cell: bold only for a confirmatory (pre-registered) claim; an inconclusive one says what the
    design could detect, or why it cannot decide."""
    verdict = c["verdict"]
    extra = []
    if c.get("verdict_note"):
        extra.append(c["verdict_note"])
    if verdict == "inconclusive" and c.get("n", 0):
        det, sd = _num(c.get("detectable")), _num(c.get("sd_log"))
        if sd == 0:  # every seed the same ratio (a grid quantity, e.g. max stable LRs all equal): no spread to
            # size a power statement by, and nothing a test could reject "ratio = threshold" with at the threshold
            extra.append(f"all {c['n']} seeds give the same ratio")
        elif math.isfinite(det) and det > 0 and math.isfinite(sd):
            extra.append(f"detects a true ratio {'>=' if c.get('claim') == 'more' else '<='} {_f(det)} with 80% power")
        elif c.get("n_bound", 0) == 0 and c.get("n", 0) < min_seeds(c.get("test", "t")):
            extra.append(f"the {c.get('test')} test cannot reject at n={c['n']}")
    text = verdict + (f" ({'; '.join(extra)})" if extra else "")
    return f"**{text}**" if c.get("confirmatory", True) else f"{text} (exploratory)"


def _claim_lines(rep: dict[str, Any]) -> list[str]:
    lines = ["", "## Verdicts", "",
             "Each claim compares per-seed paired ratios (arm / baseline on the same seed). The estimate and "
             "interval are those of the claim's pre-registered test (method and n in each row): the geometric mean "
             "with the 95% paired t-interval on log-ratios (t), the median with the order-statistic interval "
             "(sign), the Hodges-Lehmann estimate with its interval (Wilcoxon); rank intervals carry their exact "
             "level. A seed whose ratio is only a bound (a crossing outside the evaluation grid, a diverged run, a "
             "zero statistic) never enters an interval: such claims are judged by the exact sign test on the seeds' "
             "known sides, conservatively, with at most a one-sided bound. A claim **holds** when its test rejects "
             "'ratio = threshold' at alpha 0.05 on the claimed side, **does not hold** when it rejects on the "
             "other side, and is **inconclusive** otherwise; an inconclusive row gives the true ratio the design "
             "detects with 80% power. Only pre-registered claims are confirmatory (bold); the others read "
             "'(exploratory)'. 'k/n seeds agree' counts the seeds known to lie on the claimed side.", "",
             "| claim | quantity | estimate (interval) | interval method | per-seed ratios | seeds agree | "
             "test, p | claimed | verdict here | paper's claim | registration |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for c in rep["claims"]:
        claimed = f"{'>' if c.get('claim') == 'more' else '<'} {_f(c['threshold'])}"
        bounds = c.get("bounds") or [""] * len(c.get("per_seed", []))
        per_seed = ", ".join((f"{b} " if b and b != "?" else "") + _f(v) + ("?" if b == "?" else "")
                             for v, b in zip(c.get("per_seed", []), bounds)) or "-"
        test = c.get("test", "t")
        p = c.get("p_verdict", c.get("p", {}).get(test))
        est = _f(c.get("value"))
        if not math.isfinite(_num(c.get("value"))) and c.get("estimate_text"):
            est = c["estimate_text"]
        mc = c.get("mean_curve")
        if mc and mc.get("forward_flag") and math.isfinite(_num(c.get("value"))):
            est = f"{bound_of(mc['forward_flag'], True)}{est} ({mc['forward_flag']})"
        how = c.get("method", "") if c.get("n_bound") or c.get("n_tie") else f"{test}"
        lines.append(f"| {c['name']} | {_what(c, rep)} | {est} ({_interval(c)}) | {c.get('interval', c.get('method'))}"
                     f" | {per_seed} | {c.get('agree', 'n/a')} | {how} p={_f(p)}"
                     f"{'; Holm ' + _f(c['p_adjusted']) if 'p_adjusted' in c else ''} | {claimed} | {_verdict(c)} | "
                     f"{c.get('paper_verdict', '')} | {c.get('registration', '')} |")
        counts = []
        if c.get("n_bound"):
            counts.append(f"{c['n_bound']} of {c['n']} seeds are bounds, not values")
        if c.get("n_tie"):
            counts.append(f"{c['n_tie']} of {c['n']} seeds tie (0 on both sides) and are left out of the sign test")
        if counts or c.get("note"):
            notes.append(f"- {c['name']}: " + "; ".join(counts + ([c["note"]] if c.get("note") else [])) + ".")
        if c.get("bootstrap"):
            b = c["bootstrap"]
            notes.append(f"- {c['name']}: {b['method']}: {_f(b['ci_low'])}-{_f(b['ci_high'])}.")
    fam = rep.get("multiplicity") or {}
    if fam:
        k = fam.get("confirmatory", 0)
        rule = ("Holm's correction applies (`multiplicity: holm`): a verdict stands only where its adjusted p < "
                "0.05, which keeps that chance <= 5%." if fam.get("rule") == "holm" else
                "No correction applies (`multiplicity: none`): read the verdicts with that chance in mind.")
        notes.append(f"- Multiplicity: {k} confirmatory claim{'s' if k != 1 else ''} judged at alpha 0.05 each; "
                     f"with no effect at all, the chance of at least one false 'holds' among them is about "
                     f"{100 * fam.get('familywise_error', 0.0):.0f}% (1 - 0.95^{k}). {rule}")
    return lines + ([""] + notes if notes else [])


def _regime_lines(rep: dict[str, Any]) -> list[str]:
    from .regime import REGIME_ROWS

    ours, paper = rep.get("regime") or {}, rep.get("paper") or {}
    if not ours and not paper:
        return []
    lines = ["", "## Regime", "",
             f"The baseline's setting beside the paper's ({paper.get('source', 'no paper regime stated')}).", "",
             "| | this experiment | paper |", "|---|---|---|"]
    for key, label in REGIME_ROWS.items():
        if key in ours or key in paper:
            lines.append(f"| {label} | {_f(ours.get(key), 4)} | {paper.get(key, '-')} |")
    if paper.get("in_regime") is False:
        lines += ["", "**These runs are outside the regime the paper describes.** The verdicts say what happens "
                  "at this scale; for the paper's claims the verdict is *not tested in regime*."]
    if paper.get("note"):
        lines += ["", str(paper["note"]).strip()]
    tied = {arm: a.get("horizons_tied") for arm, a in rep["arms"].items() if a.get("horizons_tied")}
    if tied and any(CLAIM_KINDS.choose(c["kind"]).reads_time_to_target for c in rep["claims"]):
        lines += ["", "**Horizons tied to the budget.** These arms' schedules end at train.steps, so 'steps to reach "
                  "X' is not what a shorter run would need: " + "; ".join(f"{arm}: {', '.join(h)}"
                                                                         for arm, h in tied.items()) + "."]
    return lines


def _calibration_lines(rep: dict[str, Any]) -> list[str]:
    cal = rep.get("calibration") or {}
    if not cal:
        return ["", "## Metric noise", "", "Not measured for this experiment (`steadydiff compare ... --calibrate`)."]
    lines = ["", "## Metric noise (calibration)", "",
             f"Each metric re-measured {cal['repeats']} times independently at the final checkpoint (sampling "
             "seeds for sample metrics, validation sets for validation losses), against one large-n reference.",
             "The last column is the smallest ratio a paired design of 5 / 8 seeds could resolve if this noise "
             "were the only seed-to-seed variation (log-ratio sd = sqrt(2) sd / mean; 80% power, alpha 0.05).",
             "", "| metric | run | n | values | mean +- sd | reference (n) | bias | noise-only MDR, 5 / 8 seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in cal["runs"]:
        lines.append(f"| {r.get('metric', cal['metric'])} | {r['arm']}/seed-{r['seed']} (step {r['step']}) | "
                     f"{r['n']} | "
                     f"{', '.join(_f(v, 4) for v in r['values'])} | {_f(r['mean'], 4)} +- {_f(r['sd'], 2)} | "
                     f"{_f(r['reference'], 4)} ({r['reference_n']}) | {_f(r['bias'], 3)} | "
                     + " / ".join(_f(minimum_detectable_ratio(math.sqrt(2) * r["sd"] / abs(r["mean"]), n), 4)
                                  for n in (5, 8)) + " |")
    if cal["seeds"] < 2:
        return lines
    lines += ["", f"`{cal['metric']}`: coefficient of variation {_f(cal['cv'])}; with {cal['seeds']} paired seeds, "
              "metric noise alone "
              f"limits resolvable final-metric ratios to beyond {_f(cal['mdr_noise'])} (80% power, alpha 0.05); the "
              "per-claim figures above include the seed-to-seed spread as well."]
    return lines


def _nfe_lines(rep: dict[str, Any]) -> list[str]:
    """Per metric logged at network-evaluation budgets (train.eval_nfe): per arm and NFE, the median over seeds
    of the final value, then the per-seed values; and its plot."""
    lines: list[str] = []
    for key, d in (rep.get("nfe") or {}).items():
        nfes = d["nfe"]
        lines += ["", f"## Final {key} against network evaluations (NFE)", "",
                  f"Each run's last `{key}@nfe<N>`: its sampler at the most steps within N network evaluations "
                  "(train.eval_nfe), same sampling seed at every N. Median over seeds (per-seed values).", "",
                  "| arm | " + " | ".join(f"NFE {n}" for n in nfes) + " |", "|---|" + "---|" * len(nfes)]
        for arm, per in d["arms"].items():
            cells = []
            for n in nfes:
                vals = [_num(v) for v in per.get(str(n), per.get(n, []))]
                cells.append(f"{_f(float(np.median(vals)), 4)} ({', '.join(_f(v, 4) for v in vals)})" if vals else "-")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        name = key.removeprefix("eval/")
        lines += ["", f"![{name} vs NFE]({name}_vs_nfe.png)"]
    return lines


def write_markdown(rep: dict[str, Any], out: Path) -> str:
    m = rep["machine"]
    # lead.md: the authors' current answer, written when a later experiment supersedes these runs (a held-out
    # figure, a fixed horizon); it goes first so a reader meets it before this experiment's own verdicts.
    lead = out / "lead.md"
    lines = [
        f"# Experiment: {rep['experiment']}", "",
        *([lead.read_text().rstrip(), ""] if lead.is_file() else []),
        rep["description"].strip(), "",
        f"- Command: `{rep['command']}`" if rep["command"] else "",
        f"- Report regenerated from the finished runs by: `{rep['report_command']}`" if rep.get("report_command")
        else "",
        f"- Experiment file: `{rep['source']}`",
        f"- Machine: {m['cpu']}, {m['cores']} cores{', ' + m['gpu'] if 'gpu' in m else ''}; torch {m['torch']}, "
        f"python {m['python']}",
        f"- Date: {rep['date']}; training wall time, all runs: {rep['wall_s_total'] / 60:.1f} min",
        f"- Metric: `{rep['metric']}` ({'lower' if rep['lower_is_better'] else 'higher'} is better), evaluated at "
        f"steps {rep['grid'][0]}..{rep['grid'][-1]} ({len(rep['grid'])} points); seeds {rep['seeds']} "
        f"(n = {len(rep['seeds'])}, paired)",
    ]
    lines += _regime_lines(rep) + _claim_lines(rep)
    lines += ["", "## Speed-up as a time shift, and final quality", "",
              "On the seed-mean curves: forward = the step at which the baseline reaches the arm's value at 50% / "
              "75% / 100% of the budget, over that step (an arm slightly behind scores slightly below 1); reverse = "
              "that step over the step at which the arm reaches the baseline's value. Crossings are interpolated "
              "between evaluations, extrapolated at most one evaluation interval past the end (flagged), and "
              "otherwise reported as bounds (>=, <=). Final: mean +- sd over seeds, then the per-seed values.", "",
              "| arm | forward 50% | forward 75% | forward 100% | reverse 100% | final metric | per seed | "
              "diverged |", "|---|---|---|---|---|---|---|---|"]
    for name, a in rep["arms"].items():
        ts = a.get("time_shift", {})
        cells = []
        for t in ("half", "three_quarters", "final"):
            x = ts.get(t)
            cells.append("-" if x is None else f"{bound_of(x['forward_flag'], True)}{_f(x['forward'])}x"
                         + (" (extrap.)" if x["forward_flag"] == "extrapolated" else ""))
        x = ts.get("final")
        cells.append("-" if x is None else f"{bound_of(x['reverse_flag'], False)}{_f(x['reverse'])}x")
        at = {str(k): v for k, v in a["diverged_at"].items()}  # keys are strings once read back from JSON
        div = ", ".join(f"seed {s} at step {at[str(s)]}" for s in a["diverged"]) or "0"
        lines.append(f"| {name} | {' | '.join(cells)} | {_f(a['final_mean'], 4)} +- {_f(a['final_sd'], 2)} | "
                     f"{', '.join(_f(v, 4) for v in a['final_per_seed'])} | {div} |")
    if any("late_change_per_seed" in a for a in rep["arms"].values()):
        lines += ["", "## Has it plateaued? (change over the last 25% of the budget)", "",
                  f"Relative change of {rep['metric']} per 1,000 steps, from a least-squares line through its log "
                  "over the evaluations in the last quarter of the run (0 = flat; -0.05 = still falling 5% per 1k "
                  "steps).", "", "| arm | mean | per seed |", "|---|---|---|"]
        for name, a in rep["arms"].items():
            ch = [_num(v) for v in a.get("late_change_per_seed", [])]
            fin = [v for v in ch if math.isfinite(v)]
            lines.append(f"| {name} | {_pct(float(np.mean(fin))) if fin else '-'} | "
                         f"{', '.join(_pct(v) for v in ch)} |")
    stab_keys = sorted({k for a in rep["arms"].values() for k in a["stability"]})
    if stab_keys:
        stats = [("median_abs_log_delta", "mald"), ("detrended_cv", "dcv"), ("spike_frac_3x", "spk3"),
                 ("spike_frac_5x", "spk5"), ("max_to_median", "max/med")]
        lines += ["", "## Stability (after warm-up; mean over seeds)", "",
                  "`mald` = median |delta log| between consecutive values; `dcv` = detrended coefficient of variation "
                  "(std around a centred moving average / its mean: a pure trend scores 0); `spk3`, `spk5` = fraction "
                  "of points above 3x / 5x the trailing running median; `max/med` = the largest such ratio.", "",
                  "| arm | series | " + " | ".join(lbl for _, lbl in stats) + " |", "|---|---|" + "---|" * len(stats)]
        for name, a in rep["arms"].items():
            for k in stab_keys:
                s = a["stability"].get(k)
                if s:
                    lines.append(f"| {name} | {k} | " + " | ".join(_f(s[st]["mean"]) if st in s else "-"
                                                                  for st, _ in stats) + " |")
    if any("sensitivity" in a for a in rep["arms"].values()):
        ts = list(next(a for a in rep["arms"].values() if "sensitivity" in a)["sensitivity"]["per_t"])
        lines += ["", "## Input sensitivity of the final EMA model", "",
                  "R(t) = ||eps(x_t + d) - eps(x_t)|| / ||d|| for small random perturbations d (mean over seeds).", "",
                  "| arm | " + " | ".join(f"t={t}" for t in ts) + " |", "|---|" + "---|" * len(ts)]
        for name, a in rep["arms"].items():
            if "sensitivity" in a:
                lines.append(f"| {name} | " + " | ".join(_f(a["sensitivity"]["per_t"].get(t)) for t in ts) + " |")
    lines += _nfe_lines(rep)
    lines += _calibration_lines(rep)
    lines += ["", "## Plots", "", "![metric vs steps](metric.png)", "", "![stability](stability.png)", ""]
    reading = out / "reading.md"  # the authors' reading of the results, written after the runs, kept as it is
    if reading.is_file():
        lines += [reading.read_text().rstrip(), ""]
    text = "\n".join(ln for ln in lines if ln is not None) + "\n"
    atomic_write_text(out / "report.md", text)
    return text


def plot_experiment(exp: Experiment, rep: dict[str, Any], out: Path) -> None:
    """metric.png (seed-mean curves with min-max bands and the targets) and stability.png (overlays)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = rep["grid"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
    for name, a in rep["arms"].items():
        mean = np.array([float(v) for v in a["curve_mean"]])
        lo = np.array([float(v) for v in a["curve_min"]])
        hi = np.array([float(v) for v in a["curve_max"]])
        finite = np.isfinite(mean)
        (line,) = axes[0].plot(np.array(grid)[finite], mean[finite], lw=1.5, label=name)
        ok = np.isfinite(lo) & np.isfinite(hi)
        axes[0].fill_between(np.array(grid)[ok], lo[ok], hi[ok], alpha=0.15, color=line.get_color())
    axes[0].set_xlabel("step")
    axes[0].set_ylabel(rep["metric"])
    axes[0].set_title("metric vs steps\n(mean over seeds, band = min..max)", fontsize=10)
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    names = list(rep["arms"])
    shifts = [rep["arms"][n].get("time_shift", {}).get("final") for n in names]
    pts = [min(_num(s["forward"]), 10.0) if s else 0.0 for s in shifts]
    axes[1].bar(names, pts, color="tab:blue", alpha=0.6)
    for i, shift in enumerate(shifts):  # the per-seed values over the bar
        seeds = (shift or {}).get("per_seed", [])
        axes[1].scatter([i] * len(seeds), [min(_num(v), 10.0) for v in seeds], color="black", s=8, zorder=3)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_title("time-shift speed-up at the full budget\n(bar: seed-mean curves, dots: seeds; capped at 10)",
                      fontsize=10)
    axes[1].tick_params(axis="x", rotation=30, labelsize=7)
    fig.tight_layout()
    atomic_write(out / "metric.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)

    keys = exp.stability or ["loss"]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), dpi=100, squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name in exp.arms:
            runs = []
            for s in exp.seeds:
                st, v = series(read_metrics(run_dir(out, name, s)), key)
                runs.append((st, v))
            n = min((len(v) for _, v in runs), default=0)
            if n < 2:
                continue
            m = np.mean([v[:n] for _, v in runs], axis=0)
            w = max(1, n // 50)
            sm = moving_average(m, w) if w > 1 else m
            ax.plot(runs[0][0][:n][len(runs[0][0][:n]) - len(sm):], sm, lw=1, label=name)
        ax.set_yscale("log")
        ax.set_title(f"{key} (mean over seeds, smoothed)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(out / "stability.png", lambda p: fig.savefig(p, format="png"))
    plt.close(fig)
    for key, d in (rep.get("nfe") or {}).items():
        _plot_nfe(plt, key, d, out / f"{key.removeprefix('eval/')}_vs_nfe.png")


def _plot_nfe(plt, key: str, d: dict[str, Any], path: Path) -> None:
    """<metric>_vs_nfe.png: the final value against NFE (log x), a line per arm through the seed medians, the
    seeds as faint points."""
    nfes = [int(n) for n in d["nfe"]]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for arm, per in d["arms"].items():
        vals = [[_num(v) for v in per.get(str(n), per.get(n, []))] for n in nfes]
        med = np.array([np.median(v) if v else math.nan for v in vals])
        ok = np.isfinite(med)
        (line,) = ax.plot(np.array(nfes)[ok], med[ok], marker="o", lw=1.5, label=arm)
        xs = [n for n, v in zip(nfes, vals) for x in v if math.isfinite(x)]
        ys = [x for v in vals for x in v if math.isfinite(x)]
        ax.scatter(xs, ys, color=line.get_color(), alpha=0.3, s=10)
    ax.set_xscale("log")
    ax.set_xticks(nfes, [str(n) for n in nfes])
    ax.minorticks_off()
    ax.set_xlabel("network evaluations per sample (NFE)")
    ax.set_ylabel(f"final {key}")
    ax.set_title(f"final {key} vs NFE\n(line: median over seeds, points: seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png"))
    plt.close(fig)
