"""Economics sections of `ledger report` (seed 002 §15.7, §15.8.2, §15.10.3).

7. **Cohort dispositions** — per collection run, every attempt once (emitted, assessed but
   not selected, ineligible, pending, unknown) at the projection's current state, with the
   emission yield and the cost per emitted artifact (:mod:`ledger.reports.cohort`).
8. **Collection credit usage over time** — per pool, credits held after every credit
   event of the fold (``credit_decisions``), against the high watermark and the hard limit
   (:mod:`projections.credits`).
9. **Loop telemetry** — per round, distinct normalised action sequences per fixture, pass@1
   vs pass@k and the held-out score, with the coverage-narrowing warnings
   (:mod:`ledger.reports.telemetry`).

Each section degrades to a "no data" note.  :mod:`ledger.reports.report` calls :func:`collect`,
:func:`plots` and :func:`tables`; the data live in ``ReportData.economics``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from ledger.algorithms.economics import DISPOSITIONS
from ledger.reports.cohort import cohort_dispositions, cohorts
from ledger.projections.credits import credit_pools, pool_status, usage_series
from ledger.reports.telemetry import loop_telemetry

__all__ = ["SECTIONS", "collect", "plots", "tables"]

SECTIONS = [
    ("dispositions", "Cohort dispositions and cost per emitted artifact",
     "Every attempt of each collection run (collection_run_id) appears once: emitted, assessed but not selected, "
     "ineligible, pending or unknown (seed 002 table 15), at the projections' current state; "
     "`ledger cohort report COHORT --cutoff T` gives the same table at a cutoff. Cost per emitted artifact = "
     "cohort cost / emitted (equation 5)."),
    ("credits", "Collection credit usage over time",
     "Credits held after every reservation and release of each pool, as the credit projection folds them "
     "(seed 002 §15.8.2): dispatch slows above the high watermark and stops at the hard limit. The store has two "
     "limits, outstanding records (the hard limit) and bytes; the table names the binding one, gives each one's "
     "time to exhaustion under the declared timeout burst and the watermark sized on each (seed 002 exercise 7)."),
    ("telemetry", "Self-improvement loop telemetry",
     "Per round: distinct normalised action sequences per fixture, pass@1 vs pass@k on training fixtures and the "
     "held-out score (seed 002 §15.7.2). Diversity falling while held-out scores stay flat warns of coverage narrowing."),
]

_COLORS = {"emitted": "#55a868", "assessed_not_selected": "#4c72b0", "ineligible": "#c44e52", "pending": "#c4ad66",
           "unknown": "#8172b3"}


# ---------------------------------------------------------------------- data
def collect(db: sqlite3.Connection, notes: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"cohorts": {}, "pools": {}, "loop": None}
    _cohorts(db, out, notes)
    _credits(db, out, notes)
    _loop(db, out, notes)
    return out


def _cohorts(db: sqlite3.Connection, out: dict, notes: dict[str, str]) -> None:

    try:
        runs = cohorts(db)
        if not runs:
            notes["dispositions"] = "no execution names a collection run (execution_opened.collection_run_id)"
            return
        for run in runs:
            out["cohorts"][run] = cohort_dispositions(db, run)
    except (sqlite3.OperationalError, KeyError) as exc:
        notes["dispositions"] = f"dispositions not available ({exc})"
        out["cohorts"] = {}


def _credits(db: sqlite3.Connection, out: dict, notes: dict[str, str]) -> None:

    pools = credit_pools(db)
    if not pools:
        notes["credits"] = "no credit pool declared and no credit event (credit projection empty)"
        return
    for pool in pools:
        out["pools"][pool] = {"status": pool_status(db, pool), "series": usage_series(db, pool)}
    if not any(p["series"] for p in out["pools"].values()):
        notes["credits"] = "no credit has been reserved in any declared pool yet"


def _loop(db: sqlite3.Connection, out: dict, notes: dict[str, str]) -> None:

    try:
        rep = loop_telemetry(db)
    except sqlite3.OperationalError as exc:
        notes["telemetry"] = f"telemetry not available ({exc})"
        return
    if not rep["rounds"] or not any(r["pass_at_1"] is not None for r in rep["rounds"]):
        notes["telemetry"] = "no scored training executions yet"
    out["loop"] = rep


# ---------------------------------------------------------------------- plots
MAX_ROUND_LABELS = 12
"""Most round labels on a loop-telemetry x axis (the rounds between are thinned out)."""


def plots(plt, econ: dict, out: Path, save) -> dict[str, str | None]:
    return {"dispositions": _plot_dispositions(plt, econ, out, save), "credits": _plot_credits(plt, econ, out, save),
            "telemetry": _plot_loop(plt, econ, out, save)}


def _plot_dispositions(plt, econ: dict, out: Path, save) -> str | None:
    cohorts = {k: v for k, v in econ["cohorts"].items() if v["attempts"]}
    if not cohorts:
        return None
    names = list(cohorts)
    fig, ax = plt.subplots(figsize=(8, 1.0 + 0.5 * len(names)))
    left = [0.0] * len(names)
    for d in DISPOSITIONS:
        shares = [cohorts[n]["dispositions"][d]["attempts"] / cohorts[n]["attempts"] for n in names]
        ax.barh(names, shares, left=left, color=_COLORS[d], label=d.replace("_", " "))
        left = [a + b for a, b in zip(left, shares)]
    for y, n in enumerate(names):
        c = cohorts[n]
        per = c["cost"]["per_emitted_artifact"]
        if not c["cost"]["by_currency"]:  # no cost_recorded event: a cost of 0.00 would be a claim
            label = f"{c['emitted']}/{c['attempts']} emitted, no cost recorded"
        else:
            label = f"{c['emitted']}/{c['attempts']} emitted" + (f", {per:.2f} per artifact" if per is not None else "")
        ax.text(1.01, y, label, va="center", fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of attempts")
    ax.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    return save(fig, out, "cohort_dispositions.png")


def _plot_credits(plt, econ: dict, out: Path, save) -> str | None:
    pools = {k: v for k, v in econ["pools"].items() if v["series"] and v["status"] and v["status"]["declared"]}
    if not pools:
        return None
    fig, axes = plt.subplots(len(pools), 1, figsize=(8, 2.6 * len(pools)), squeeze=False)
    for ax, (pool, p) in zip(axes[:, 0], pools.items()):
        st, series = p["status"], p["series"]
        t0 = series[0]["at"]
        xs = [(r["at"] - t0) / 1e6 for r in series]
        ax.step(xs, [r["held"] for r in series], where="post", color="#4c72b0", label="credits held")
        refused = [(x, r["held"]) for x, r in zip(xs, series) if r["decision"] == "refuse"]
        if refused:
            ax.scatter([x for x, _ in refused], [h for _, h in refused], s=8, color="#c44e52", label="refused", zorder=3)
        limit = st["effective_limit"]
        ax.axhline(limit, color="#c44e52", linestyle="--", linewidth=0.8, label=f"hard limit ({limit})")
        wm = st["watermark_bytes"] / st["record_ceiling_bytes"] if st["record_ceiling_bytes"] else None
        if wm is not None and wm < limit:
            ax.axhline(wm, color="#c4ad66", linestyle=":", linewidth=0.9,
                       label=f"high watermark ({100 * st['high_watermark']:.1f}% of the "
                             f"{'record' if st.get('watermark_limit') == 'records' else 'byte'} limit)")
        ax.set_title(f"pool {pool}")
        ax.set_xlabel("seconds since the first credit event")
        ax.set_ylabel("credits")
        ax.legend(fontsize=7, loc="upper left")
    return save(fig, out, "credit_usage.png")


def _plot_loop(plt, econ: dict, out: Path, save) -> str | None:
    rep = econ.get("loop")
    if not rep or not rep["rounds"] or not any(r["pass_at_1"] is not None for r in rep["rounds"]):
        return None
    rounds = rep["rounds"]
    xs = list(range(len(rounds)))
    labels = [r["round"] for r in rounds]
    # rounds of a training loop revisit fixtures: joined by lines; rounds that share no fixture are
    # independent cohorts (collection runs ordered by their first execution): points, never a zig-zag line
    seen: dict[str, set] = {}
    for f in rep.get("fixtures") or []:
        seen.setdefault(f["fixture"], set()).add(f["round"])
    ordered = len(rounds) < 2 or any(len(v) > 1 for v in seen.values())
    join = {} if ordered else {"linestyle": "none"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    axes[0].plot(xs, [r["distinct_sequences"] for r in rounds], marker="o", color="#4c72b0", **join)
    axes[0].set_title("distinct action sequences per fixture")
    axes[0].set_ylim(bottom=0)
    # pass@1 <= pass@k, and often equal: pass@1 is drawn last, on top (zorder), dashed with
    # diamonds, so it stays visible where the two lines coincide
    for key, color, name, style in (
            ("pass_at_k", "#55a868", "pass@k", {"marker": "o", "linewidth": 2.5, "zorder": 2}),
            ("held_out_score", "#c44e52", "held-out", {"marker": "s", "zorder": 2}),
            ("pass_at_1", "#dd8452", "pass@1", {"marker": "D", "markersize": 4, "linestyle": "--", "zorder": 3})):
        ys = [r[key] if r[key] is not None else float("nan") for r in rounds]
        axes[1].plot(xs, ys, color=color, label=name, **{**style, **join})
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title("training pass rates vs held-out score")
    axes[1].legend(fontsize=7)
    step = -(-len(xs) // MAX_ROUND_LABELS)  # every step-th round labelled: at most MAX_ROUND_LABELS labels
    for ax in axes:
        ax.set_xticks(xs[::step], labels[::step])
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")
            t.set_rotation_mode("anchor")
        ax.set_xlabel("round" if ordered else "collection run (by first execution; unordered cohorts)")
    for w in rep["warnings"]:
        if w["rule"] == "diversity_falls_held_out_flat":
            i = labels.index(w["round"])
            axes[0].annotate("narrowing", (i, rounds[i]["distinct_sequences"]), textcoords="offset points",
                             xytext=(0, 8), ha="center", fontsize=7, color="#c44e52")
    return save(fig, out, "loop_telemetry.png")


# ---------------------------------------------------------------------- tables
def tables(econ: dict, table) -> dict[str, str]:
    rows = []
    for run, c in econ["cohorts"].items():
        row = {"cohort": run, "attempts": c["attempts"]}
        row.update({d: c["dispositions"][d]["attempts"] for d in DISPOSITIONS})
        row.update({"emission_yield": c["emission_yield"], "cost": c["cost"]["total"],
                    "per_emitted_artifact": c["cost"]["per_emitted_artifact"]})
        rows.append(row)
    pools = []
    for pool, p in econ["pools"].items():
        st = p["status"] or {}
        limits = st.get("limits") or {}
        pools.append({"pool": pool, "declared": st.get("declared"), "held": st.get("held"),
                      "limit": st.get("effective_limit"), "watermark": st.get("high_watermark"),
                      "watermark_on": st.get("watermark_limit"), "binding": st.get("binding_limit"),
                      "running": st.get("running"), "staged": st.get("staged"), "disposed": st.get("disposed"),
                      "armed_releases": st.get("armed_releases"), "drain_s": st.get("drain_s"),
                      "exhaustion_s": st.get("exhaustion_s"),
                      **{f"{k}_exhaustion_s": limits.get(k, {}).get("exhaustion_s") for k in ("records", "bytes")},
                      **{f"{k}_watermark": limits.get(k, {}).get("high_watermark") for k in ("records", "bytes")},
                      "decisions": st.get("counts")})
    loop = econ.get("loop") or {"rounds": [], "warnings": []}
    rounds = [{"round": r["round"], "fixtures": r["fixtures"], "attempts": r["attempts"],
               "distinct_sequences": r["distinct_sequences"], "pass_at_1": r["pass_at_1"], "pass_at_k": r["pass_at_k"],
               "informative": r["informative_expected"], "acceptance": r["train_acceptance"],
               "held_out": r["held_out_score"], "external_anchor_share": r["anchors"]["retained"]["external"]}
              for r in loop["rounds"]]
    warnings = [{"warning": w["rule"], "round": w["round"], "since": w["since_round"], "detail": w["detail"]}
                for w in loop["warnings"]]
    return {
        "dispositions": table(rows, ["cohort", "attempts", *DISPOSITIONS, "emission_yield", "cost",
                                     "per_emitted_artifact"]),
        "credits": table(pools, ["pool", "declared", "held", "limit", "watermark", "watermark_on", "binding", "running",
                                 "staged", "disposed", "armed_releases", "drain_s", "exhaustion_s",
                                 "records_exhaustion_s", "bytes_exhaustion_s", "records_watermark", "bytes_watermark",
                                 "decisions"]),
        "telemetry": table(rounds, ["round", "fixtures", "attempts", "distinct_sequences", "pass_at_1", "pass_at_k",
                                    "informative", "acceptance", "held_out", "external_anchor_share"])
        + table(warnings, ["warning", "round", "since", "detail"]),
    }
