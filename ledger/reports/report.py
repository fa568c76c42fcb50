"""`ledger report --out DIR`: one HTML page with matplotlib plots (SPEC §7.2).

Sections, each computed from the projection database and each degrading to a "no data"
note when its projection is empty or absent:

1. **Admission funnel per route** — executions evaluated, how many get past each predicate
   of the cascade in order, admitted (+ dummies); from ``admission`` / ``routes``.
2. **Token shares by role class** — per route, each role class's share of records, stored
   tokens and target tokens (seed 002 §15.6.4's three denominators), from
   :func:`ledger.corpus.export.accounting`.
3. **Split sizes** — task groups and trajectories (executions) per split, from the split map
   (``projections.splits.execution_split``).
4. **Tree shapes** — per execution: depth, branching (children per internal node), and
   stored / expanded tokens; from ``tree_nodes`` / ``tree_stats``.
5. **Cost per emitted artifact** — cohort cost / emitted artifacts per route (seed 002
   equation 5), plus cost by category (``execution_costs``).
6. **Withdrawn members over manifest versions** — for every published version (table
   ``manifests``), its members and how many are withdrawn now; members come from the
   archived documents, authenticated by the log's ``manifest_sha256``.
7-9. **Cohort dispositions**, **collection credit usage over time** and **loop telemetry**
   (seed 002 §15.10.3, §15.8.2, §15.7) — see :mod:`ledger.reports.report_economics`.
10. **Canaries** (SPEC §11.2) — declared canaries (id, length, scope; never their value) and
    what each published training manifest's scan found (planted / scanned / escaped).
11. **Capture gateway drift by cause** (SPEC §7.6) — a table-only section from the store's
    ``gateway.db`` (the counts `ledger status --json` reports); left out when no gateway ran.

:func:`build_report` works on any projection connection (tests use it directly);
:func:`write_report` first brings the store's projections up to date.
"""

from __future__ import annotations

import html
import json
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ledger.log.paths import StorePaths
from ledger.projections.admission import current_routes
from ledger.corpus.export import accounting
from ledger.projections.manifests import published_manifests
from ledger.corpus.manifest import document_sha256
from ledger.reports import report_economics
from ledger.projections import collections as _collections
from ledger.projections import verifier as _verifier
from ledger.projections.canaries import declared
from ledger.reports.report_economics import SECTIONS
from ledger.corpus.publish import _engine, archive_path, load_manifest
from ledger.events.signing import Trust
from ledger.log import open_log
from ledger.projections.registry import store_keystore
from ledger.projections.governance import withdrawn

__all__ = ["ReportData", "build_report", "collect", "write_report"]

ROLE_ORDER = ("main/task", "main/summary", "sub/task", "sub/summary", "dummy", "not_selected")
SPLIT_ORDER = ("train", "dev", "final_test", "reserve")


def _has(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


# ---------------------------------------------------------------------- data
@dataclass
class ReportData:
    funnels: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    telemetry: list[dict] = field(default_factory=list)
    shares: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # route -> role -> volumes
    splits: dict[str, dict[str, int]] = field(default_factory=dict)  # split -> {groups, trajectories}
    trees: list[dict] = field(default_factory=list)  # per execution
    costs: dict[str, dict] = field(default_factory=dict)  # route -> {cohort, emitted, per_emitted_artifact}
    cost_categories: dict[str, float] = field(default_factory=dict)
    manifests: list[dict] = field(default_factory=list)  # route, version, members, withdrawn, available
    branching: Counter = field(default_factory=Counter)  # children per internal node (root included) -> nodes
    notes: dict[str, str] = field(default_factory=dict)  # section -> why there is no data
    economics: dict = field(default_factory=dict)  # cohorts, credit pools, loop telemetry (ledger.reports.report_economics)


def _routes(db: sqlite3.Connection) -> dict:
    if not _has(db, "routes"):
        return {}

    return current_routes(db)


def _funnels(db: sqlite3.Connection, data: ReportData) -> None:
    routes = _routes(db)
    if not routes or not _has(db, "admission"):
        data.notes["funnel"] = "no admission policy declared yet (admission projection empty)"
        return
    for name, r in routes.items():
        rows = db.execute("SELECT state, predicate FROM admission WHERE route = ?", (name,)).fetchall()
        if not rows:
            continue
        stops = Counter(p for s, p in rows if s in ("rejected", "unresolved"))
        reached = len(rows)
        stages = [("evaluated", reached)]
        for p in r.predicates:
            reached -= stops.get(p.name, 0)
            stages.append((f"passed {p.name}", reached))
        states = Counter(s for s, _ in rows)
        stages.append(("admitted", states.get("admitted", 0)))
        stages.append(("dummy", states.get("dummy", 0)))
        data.funnels[name] = stages
        data.telemetry.append({"route": name, "version": r.version, "use": r.use, "split": r.split,
                               "evaluated": len(rows), "admitted": states.get("admitted", 0),
                               "dummy": states.get("dummy", 0), "rejected": states.get("rejected", 0),
                               "unresolved": states.get("unresolved", 0),
                               "stopped_by": dict(sorted(stops.items(), key=lambda kv: str(kv[0])))})
    if not data.funnels:
        data.notes["funnel"] = "no execution has been evaluated on any route yet"


def _shares_and_costs(db: sqlite3.Connection, data: ReportData) -> None:
    routes = _routes(db)
    if not routes:
        data.notes["shares"] = data.notes["cost"] = "no admission policy declared yet"
        return

    for name in routes:
        try:
            acc = accounting(db, name)
        except (sqlite3.OperationalError, KeyError) as exc:
            data.notes["shares"] = data.notes["cost"] = f"accounting not available ({exc})"
            return
        by_role = {}
        for role, vol in acc.get("by_role_class", {}).items():
            by_role[role] = {"records": vol.get("records", 0), "stored_tokens": vol.get("stored_tokens", 0),
                             "target_tokens": vol.get("target_tokens", 0)}
        if acc.get("dummies"):
            by_role["dummy"] = {"records": acc["dummies"], "stored_tokens": 0, "target_tokens": 0}
        if any(sum(v.values()) for v in by_role.values()):
            data.shares[name] = by_role
        cost = acc.get("cost") or {}
        if acc.get("attempts"):
            data.costs[name] = {"cohort": cost.get("cohort", 0.0), "emitted": cost.get("emitted", 0),
                                "per_emitted_artifact": cost.get("per_emitted_artifact"),
                                "attempts": acc.get("attempts", 0)}
    if not data.shares:
        data.notes["shares"] = "no admitted records on any route yet"
    if not data.costs or not any(c["cohort"] for c in data.costs.values()):
        data.notes.setdefault("cost", "no cost_recorded events for evaluated executions")
    if _has(db, "execution_costs"):
        for cat, amount in db.execute("SELECT COALESCE(category, 'uncategorised'), SUM(amount) FROM execution_costs "
                                      "GROUP BY 1 ORDER BY 1"):
            data.cost_categories[cat] = float(amount)


def _splits(db: sqlite3.Connection, data: ReportData) -> None:
    try:
        from ledger.projections import splits  # type: ignore[attr-defined]

        fn = getattr(splits, "execution_split")
    except (ImportError, AttributeError):
        data.notes["splits"] = "no split map (projection `splits` not available)"
        return
    if not _has(db, "executions"):
        data.notes["splits"] = "no executions recorded yet"
        return
    groups: dict[str, set] = defaultdict(set)
    trajectories: Counter = Counter()
    for (ex,) in db.execute("SELECT execution_id FROM executions ORDER BY execution_id"):
        try:
            split, group, _q = fn(db, ex)
        except (KeyError, LookupError, sqlite3.OperationalError):
            continue
        if split is None:
            continue
        groups[split].add(group)
        trajectories[split] += 1
    for split in sorted(trajectories, key=lambda s: (SPLIT_ORDER.index(s) if s in SPLIT_ORDER else 9, s)):
        data.splits[split] = {"groups": len(groups[split]), "trajectories": trajectories[split]}
    if not data.splits:
        data.notes["splits"] = "no execution has a split assigned yet (declare a split policy)"


def _trees(db: sqlite3.Connection, data: ReportData) -> None:
    if not _has(db, "tree_stats") or not _has(db, "tree_nodes"):
        data.notes["trees"] = "no prefix trees (tree projection empty)"
        return
    stats = {r[0]: r[1:] for r in db.execute("SELECT execution_id, requests, nodes, stored_tokens, expanded_tokens "
                                             "FROM tree_stats ORDER BY execution_id")}
    parents: dict[str, dict[int, int | None]] = defaultdict(dict)
    for ex, node, parent in db.execute("SELECT execution_id, node_id, parent FROM tree_nodes ORDER BY execution_id"):
        parents[ex][node] = parent
    for ex, (requests, nodes, stored, expanded) in stats.items():
        par = parents.get(ex, {})
        children = Counter(par.values())
        depth: dict[int, int] = {}

        def depth_of(n: int) -> int:
            chain = []
            while n is not None and n not in depth:
                chain.append(n)
                n = par.get(n)
            d = 0 if n is None else depth[n]
            for m in reversed(chain):
                d += 1
                depth[m] = d
            return depth[chain[0]] if chain else d

        max_depth = max((depth_of(n) for n in par), default=0)
        internal = [c for k, c in children.items() if k is not None]
        data.branching.update(internal + ([children[None]] if children.get(None) else []))
        data.trees.append({"execution_id": ex, "requests": requests, "nodes": nodes, "stored_tokens": stored,
                           "expanded_tokens": expanded, "depth": max_depth,
                           "root_children": children.get(None, 0),
                           "mean_branching": (sum(internal) / len(internal)) if internal else 0.0,
                           "max_branching": max(internal + [children.get(None, 0)], default=0),
                           "ratio": (stored / expanded) if expanded else None})
    if not data.trees:
        data.notes["trees"] = "no prefix trees (tree projection empty)"


def _manifests(db: sqlite3.Connection, data: ReportData, documents: Callable[[dict], dict | None] | None) -> None:

    rows = published_manifests(db)
    if not rows:
        data.notes["manifests"] = "no manifest published yet"
        return
    for row in rows:
        doc = documents(row) if documents else None
        entry = {"route": row["route"], "version": row["version"], "members": row["size"], "root": row["root"],
                 "log_position": row["log_position"], "withdrawn": None, "withdrawn_members": []}
        authentic = doc is not None and document_sha256(doc) == row["manifest_sha256"]
        if authentic and isinstance(doc.get("canaries"), dict):
            entry["canaries"] = doc["canaries"]  # the scan's figures (semantics-3 training manifests)
        if not authentic:
            entry["note"] = "archived document missing or not the one on the log"
        elif withdrawn is None or not _has(db, "withdrawals"):
            entry["note"] = "withdrawal state not available"
        else:
            cache: dict[str, bool] = {}
            hits = []
            for m in doc["members"]:
                ex = m.get("execution_id")
                if ex not in cache:
                    cache[ex] = bool(withdrawn(db, ex))
                if cache[ex]:
                    hits.append(m["member_id"])
            entry["withdrawn"] = len(hits)
            entry["withdrawn_members"] = hits
        data.manifests.append(entry)


def collect(db: sqlite3.Connection, documents: Callable[[dict], dict | None] | None = None) -> ReportData:
    """Gather every section's numbers from a projection database."""
    data = ReportData()
    _funnels(db, data)
    _shares_and_costs(db, data)
    _splits(db, data)
    _trees(db, data)
    _manifests(db, data, documents)

    data.economics = report_economics.collect(db, data.notes)
    return data


# ---------------------------------------------------------------------- plots
def _plt():
    import matplotlib  # cold path: matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # cold path: matplotlib

    plt.rcParams.update({"figure.dpi": 100, "font.size": 9, "svg.hashsalt": "ledger", "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, metadata={"Software": None})
    import matplotlib.pyplot as plt  # cold path: matplotlib

    plt.close(fig)
    return name


def _plot_funnel(plt, data: ReportData, out: Path) -> str | None:
    if not data.funnels:
        return None
    n = len(data.funnels)
    fig, axes = plt.subplots(n, 1, figsize=(7.5, 1.2 + 0.45 * max(len(s) for s in data.funnels.values()) * n),
                             squeeze=False)
    for ax, (route, stages) in zip(axes[:, 0], data.funnels.items()):
        labels = [s for s, _ in stages][::-1]
        values = [v for _, v in stages][::-1]
        colors = ["#4c72b0" if not (lab in ("admitted", "dummy")) else ("#55a868" if lab == "admitted" else "#c4ad66")
                  for lab in labels]
        ax.barh(labels, values, color=colors)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v}", va="center")
        ax.set_title(f"route {route}")
        ax.set_xlabel("executions")
    return _save(fig, out, "admission_funnel.png")


def _plot_shares(plt, data: ReportData, out: Path) -> str | None:
    """Per route and role class: stored tokens split into loss targets and the rest, in absolute
    numbers with the target share written beside each bar (one admitted role class no longer
    draws three 100 % bars)."""
    if not data.shares:
        return None
    n = len(data.shares)
    rows = max(len(r) for r in data.shares.values())
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 1.2 + 0.55 * rows), squeeze=False)
    for ax, (route, by_role) in zip(axes[0], data.shares.items()):
        roles = sorted(by_role, key=lambda r: (ROLE_ORDER.index(r) if r in ROLE_ORDER else 99, r))[::-1]
        target = [by_role[r]["target_tokens"] for r in roles]
        rest = [max(by_role[r]["stored_tokens"] - t, 0) for r, t in zip(roles, target)]
        ax.barh(roles, target, color="#2e8b57", label="target tokens")
        ax.barh(roles, rest, left=target, color="#b8c2cc", label="other stored tokens")
        top = max([t + o for t, o in zip(target, rest)] + [1])
        for y, (r, t, o) in enumerate(zip(roles, target, rest)):
            share = f"{100 * t / (t + o):.0f} % target" if t + o else "no tokens"
            ax.text(t + o + top * 0.01, y, f"{by_role[r]['records']:,} records · {t + o:,} tokens · {share}",
                    va="center", fontsize=7)
        ax.set_xlim(0, top * 1.9)
        ax.set_xlabel("stored tokens")
        ax.set_title(f"route {route}: tokens by role class")
        ax.legend(fontsize=7, loc="lower right")
    return _save(fig, out, "token_shares.png")


def _plot_splits(plt, data: ReportData, out: Path) -> str | None:
    if not data.splits:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    names = list(data.splits)
    for ax, key in zip(axes, ("groups", "trajectories")):
        vals = [data.splits[s][key] for s in names]
        ax.bar(names, vals, color="#4c72b0")
        for x, v in enumerate(vals):
            ax.text(x, v, str(v), ha="center", va="bottom")
        ax.set_title(f"task {key}" if key == "groups" else "trajectories (executions)")
    return _save(fig, out, "split_sizes.png")


def _plot_trees(plt, data: ReportData, out: Path) -> str | None:
    if not data.trees:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    depths = [t["depth"] for t in data.trees if t["nodes"]]  # an erased (or empty) tree has no depth
    empty = len(data.trees) - len(depths)
    axes[0].hist(depths or [0], bins=range(0, max(depths or [0]) + 2), color="#4c72b0", align="left")
    axes[0].set_title("tree depth (nodes on the longest path)"
                      + (f"\n{empty:,} execution(s) with no tokens (erased) left out" if empty else ""), fontsize=9)
    axes[0].set_xlabel("depth")
    axes[0].set_ylabel("executions")
    ks = sorted(data.branching)
    axes[1].bar([str(k) for k in ks], [data.branching[k] for k in ks], color="#dd8452")
    axes[1].set_title("branching: children per node (all trees)")
    axes[1].set_xlabel("children")
    axes[1].set_ylabel("nodes with children")
    stored = [t["stored_tokens"] for t in data.trees]
    expanded = [t["expanded_tokens"] for t in data.trees]
    axes[2].scatter(expanded, stored, s=12, color="#55a868")
    top = max(expanded + stored + [1])
    axes[2].plot([0, top], [0, top], color="grey", linewidth=0.8, linestyle="--", label="no sharing")
    axes[2].set_xlabel("expanded tokens (sum of input+output)")
    axes[2].set_ylabel("stored tokens (tree)")
    axes[2].set_title("stored vs expanded")
    axes[2].legend(fontsize=7)
    return _save(fig, out, "tree_shapes.png")


def _plot_costs(plt, data: ReportData, out: Path) -> str | None:
    routes = {r: c for r, c in data.costs.items() if c["cohort"]}
    if not routes and not data.cost_categories:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    names = list(routes)
    vals = [routes[r]["per_emitted_artifact"] or 0.0 for r in names]
    axes[0].bar(names, vals, color="#c44e52")
    for x, r in enumerate(names):
        c = routes[r]
        label = f"{c['per_emitted_artifact']:.2f}" if c["per_emitted_artifact"] is not None else "none emitted"
        axes[0].text(x, vals[x], f"{label}\n({c['emitted']}/{c['attempts']} emitted)", ha="center", va="bottom", fontsize=7)
    axes[0].set_title("cost per emitted artifact (cohort cost / emitted)")
    axes[0].set_ylim(0, 1.3 * max(vals + [1e-9]))
    if data.cost_categories:
        cats = list(data.cost_categories)
        axes[1].bar(cats, [data.cost_categories[c] for c in cats], color="#8172b3")
        axes[1].set_title("recorded cost by category")
        axes[1].tick_params(axis="x", rotation=30)
    else:
        axes[1].axis("off")
    return _save(fig, out, "cost_per_artifact.png")


def _plot_manifests(plt, data: ReportData, out: Path) -> str | None:
    if not data.manifests:
        return None
    by_route: dict[str, list[dict]] = defaultdict(list)
    for m in data.manifests:
        by_route[m["route"]].append(m)
    n = len(by_route)
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.2), squeeze=False)
    for ax, (route, rows) in zip(axes[0], by_route.items()):
        versions = [f"v{m['version']}" for m in rows]
        members = [m["members"] for m in rows]
        gone = [m["withdrawn"] or 0 for m in rows]
        ax.bar(versions, members, color="#4c72b0", label="members")
        ax.bar(versions, gone, color="#c44e52", label="withdrawn now")
        for x, m in enumerate(rows):
            if m["withdrawn"] is None:
                ax.text(x, m["members"], "?", ha="center", va="bottom")
        ax.set_title(f"route {route}: withdrawn members per version")
        ax.legend(fontsize=7)
    return _save(fig, out, "withdrawn_members.png")


# ---------------------------------------------------------------------- HTML
def _table(rows: list[dict], columns: list[str]) -> str:
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            if isinstance(v, float):
                v = f"{v:.4g}"
            elif isinstance(v, (dict, list)):
                v = json.dumps(v, sort_keys=True)
            cells.append(f"<td>{html.escape('' if v is None else str(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


_SECTIONS = [
    ("funnel", "Admission funnel per route",
     "Executions evaluated on each route and how many get past each predicate of the cascade, in order "
     "(SPEC §6.5); a missing check is never a pass, so unresolved executions stop at the predicate that waits."),
    ("shares", "Token shares by role class",
     "Share of records, stored tokens and target tokens per role class (seed 002 §15.6.4): mixtures are stated in "
     "target tokens, storage and compute are priced in stored / processed tokens."),
    ("splits", "Split sizes", "Task groups and trajectories (executions) per split (SPEC §6.3)."),
    ("trees", "Tree shapes", "Depth, branching and stored vs expanded tokens of the per-execution prefix trees (SPEC §6.1)."),
    ("cost", "Cost per emitted artifact",
     "Cohort cost divided by emitted artifacts per route (seed 002 equation 5); attempts that emit nothing still cost."),
    ("manifests", "Withdrawn members over manifest versions",
     "Published manifests cannot change; this shows, per published version, how many of its members are covered by a "
     "withdrawal today (SPEC §6.4)."),
]


_EVIDENCE = ("evidence", "Verifier integrity and collection contracts",
             "Grader calibration per evaluator version (false acceptance / rejection on its controls) and collection "
             "campaigns with their late declarations (SPEC §6.10, seed 002 §15.3): a route with calibrated_evaluators "
             "counts only calibrated versions; a rule declared after sampling is flagged in the datasheet.")


def _evidence_table(db: sqlite3.Connection) -> str:
    """The graders and campaigns tables (empty string when the log holds neither)."""

    graders = [{"evaluator": g["evaluator"], "controls": len(g["controls"]), "calibrated": g["calibrated"],
                "false_acceptance": g["false_acceptance"]["rate"], "false_rejection": g["false_rejection"]["rate"],
                "misclassified": ", ".join(g["misclassified"])} for g in _verifier.graders(db)] if _has(db, "grader_controls") else []
    campaigns = [{"collection_id": cid, "manifest_versions": s["manifest_versions"], "executions": s["executions"],
                  "declared_after_sampling": s["declared_after_sampling"]}
                 for cid, s in _collections.summaries(db).items()]
    return (_table(graders, ["evaluator", "controls", "calibrated", "false_acceptance", "false_rejection", "misclassified"])
            + _table(campaigns, ["collection_id", "manifest_versions", "executions", "declared_after_sampling"]))


_CANARIES = ("canaries", "Canaries",
             "Planted synthetic secrets (SPEC §11.2, seed 002 §15.9.3): a training manifest is signed only when no "
             "declared canary occurs in its members. Declared canaries (ids, token lengths, the splits they are planted "
             "in; never their values), then each published training manifest's scan: canaries planted at its log "
             "position, scanned for, and escaped into it.")


def _canaries_table(db: sqlite3.Connection, manifests: list[dict]) -> str:
    """Declared canaries and the published manifests' scans (empty string when there are none)."""

    rows = [{"canary_id": c["canary_id"], "tokens": len(c["token_ids"]) // 4,
             "given_as": f"text ({c['tokenizer']})" if c["tokenizer"] else "token_ids", "scope": ", ".join(c["scope"]),
             "declared_at": c["position"]} for c in declared(db)]
    scans = [{"route": m["route"], "version": m["version"], **m["canaries"]} for m in manifests if m.get("canaries")]
    return (_table(rows, ["canary_id", "tokens", "given_as", "scope", "declared_at"])
            + _table(scans, ["route", "version", "planted", "scanned", "escaped", "members_scanned", "tokens_scanned"]))


_GATEWAY = ("gateway", "Capture gateway drift by cause",
            "Calls recorded through `ledger gateway` whose history did not extend what the gateway had recorded "
            "(SPEC §7.6), by cause: template (other text rendered), retokenization (same text, other token IDs), "
            "edited_history (the harness changed a recorded message), other (nothing shared). Each was recorded as "
            "sent, so the tree branches there. Shown only for a store a gateway has recorded into.")


def _gateway_counts(paths: StorePaths) -> dict | None:
    """The store's gateway drift counts (as `ledger status --json` reports them), None without a gateway.db."""
    from ledger.gateway.store import drift_counts, gateway_db_path  # cold path: gateway.db is read by these commands only

    return drift_counts(gateway_db_path(Path(".") if paths.is_kafka else Path(paths.url)))


def _gateway_table(counts: dict | None) -> str:
    """Divergences by cause (with their share of the gateway's calls) and calls by match kind;
    the empty string when no gateway ran on the store."""
    if counts is None:
        return ""
    calls = counts["calls"]
    rows = [{"cause": cause, "divergences": n, "share_of_calls": (n / calls) if calls else 0.0}
            for cause, n in counts["drift"].items()]
    total = sum(r["divergences"] for r in rows)
    rows.append({"cause": "all causes", "divergences": total, "share_of_calls": (total / calls) if calls else 0.0})
    matches = [{"match": kind, "calls": n} for kind, n in counts["by_match"].items()]
    matches.append({"match": "all calls", "calls": calls})
    return _table(rows, ["cause", "divergences", "share_of_calls"]) + _table(matches, ["match", "calls"])


def _sections() -> list[tuple[str, str, str]]:

    return _SECTIONS + SECTIONS + [_EVIDENCE, _CANARIES, _GATEWAY]


def build_report(db: sqlite3.Connection, out: Path, *, documents: Callable[[dict], dict | None] | None = None,
                 title: str = "Trajectory ledger report", header: dict | None = None,
                 gateway: dict | None = None) -> Path:
    """Write ``index.html`` and its PNG plots into ``out``; return the HTML path. ``gateway``: the
    store's gateway drift counts (:func:`ledger.gateway.store.drift_counts`); without them the
    gateway section is left out."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = collect(db, documents)
    plt = _plt()
    images = {"funnel": _plot_funnel(plt, data, out), "shares": _plot_shares(plt, data, out),
              "splits": _plot_splits(plt, data, out), "trees": _plot_trees(plt, data, out),
              "cost": _plot_costs(plt, data, out), "manifests": _plot_manifests(plt, data, out)}

    images.update(report_economics.plots(plt, data.economics, out, _save))
    tables = {
        "funnel": _table(data.telemetry, ["route", "version", "use", "split", "evaluated", "admitted", "dummy",
                                          "rejected", "unresolved", "stopped_by"]),
        "shares": _table([{"route": r, "role_class": role, **v} for r, roles in data.shares.items()
                          for role, v in roles.items()], ["route", "role_class", "records", "stored_tokens",
                                                          "target_tokens"]),
        "splits": _table([{"split": s, **v} for s, v in data.splits.items()], ["split", "groups", "trajectories"]),
        "trees": _table(_tree_summary(data.trees), ["executions", "requests", "nodes", "stored_tokens",
                                                    "expanded_tokens", "stored/expanded", "max depth",
                                                    "max branching"]),
        "cost": _table([{"route": r, **c} for r, c in data.costs.items()],
                       ["route", "attempts", "emitted", "cohort", "per_emitted_artifact"]),
        "manifests": _table(data.manifests, ["route", "version", "members", "withdrawn", "log_position", "root"]),
        **report_economics.tables(data.economics, _table),
        "evidence": _evidence_table(db),
        "canaries": _canaries_table(db, data.manifests),
        "gateway": _gateway_table(gateway),
    }
    images.setdefault("evidence", None)  # a table-only section
    images.setdefault("gateway", None)  # table-only too
    images.setdefault("canaries", None)  # table-only too
    data.notes.setdefault("canaries", "no canary declared on the log")
    data.notes.setdefault("evidence", "no grader controls and no collection campaigns on the log")
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:2px 8px;"
             "font-size:13px;text-align:right}th{background:#f3f3f3}.nodata{color:#8a6d3b;background:#fcf8e3;"
             "padding:.5em 1em;border-left:4px solid #c4ad66}img{max-width:100%}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    if header:
        parts.append("<p>" + "; ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in header.items())
                     + "</p>")
    for key, heading, blurb in _sections():
        if key == "gateway" and gateway is None:
            continue
        parts.append(f"<h2 id='{key}'>{html.escape(heading)}</h2><p>{html.escape(blurb)}</p>")
        if images[key] is None and key in ("evidence", "canaries", "gateway") and tables[key]:
            pass  # table-only section with data
        elif images[key] is None:
            note = data.notes.get(key, "no data")
            parts.append(f"<p class='nodata'>No data: {html.escape(note)}.</p>")
        else:
            parts.append(f"<img src='{html.escape(images[key])}' alt='{html.escape(heading)}'>")
        parts.append(tables[key])
    parts.append("</body></html>\n")
    path = out / "index.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _tree_summary(trees: list[dict]) -> list[dict]:
    if not trees:
        return []
    stored = sum(t["stored_tokens"] for t in trees)
    expanded = sum(t["expanded_tokens"] for t in trees)
    return [{"executions": len(trees), "requests": sum(t["requests"] for t in trees),
             "nodes": sum(t["nodes"] for t in trees), "stored_tokens": stored, "expanded_tokens": expanded,
             "stored/expanded": (stored / expanded) if expanded else None,
             "max depth": max(t["depth"] for t in trees), "max branching": max(t["max_branching"] for t in trees)}]


def write_report(paths: StorePaths, out: Path, *, progress: Callable[[int, int], None] | None = None,
                 projections_factory: Callable[[], list] | None = None) -> Path:
    """Bring the store's projections up to date, then :func:`build_report` into ``out``."""

    def documents(row: dict) -> dict | None:
        try:
            return load_manifest(archive_path(paths, row["route"], row["version"]))
        except ValueError:
            return None


    keystore = store_keystore(paths)  # sealed requests open with the store's data keys
    with open_log(paths.url) as log:
        engine = _engine(log, paths.db, Trust.load(paths.trust), projections_factory, keystore)
        try:
            engine.run(progress=progress)
            ends = log.end_offsets()
            header = {"store": paths.url, "events": sum(ends.values())}
            return build_report(engine.db, out, documents=documents, header=header, gateway=_gateway_counts(paths))
        finally:
            engine.db.close()
            if keystore is not None:
                keystore.close()
