"""Import ATIF trajectories (Agent Trajectory Interchange Format, the ``atif`` package).

One **execution per root trajectory** (a file not referenced by another file of the same
import), named ``atif:<trajectory_id or session_id>:<file stem>`` (a root written by ``ledger
export-atif`` names its execution in ``extra.ledger.execution_id``: ``atif:<that id>``).
Inside it:

* every agent step that is a model call becomes a ``request``: ``metrics.prompt_token_ids``
  → input, ``completion_token_ids`` → output, ``logprobs`` → behaviour log-probs
  (``generator: policy``).  Consecutive calls of one agent are written with prefix
  references (SPEC §4.2), so the log does not repeat the context;
* ``observation.results[].subagent_trajectory_ref`` (file refs resolved relative to the
  referring file, or embedded ``subagent_trajectories`` by ``trajectory_id``) become
  sub-tier agents of the **same** execution, with ``turn_kind: summary`` for summarization
  sub-trajectories and the main agent's latest call as ``parent_request_id``;
* ``continued_trajectory_ref`` continues the same execution (same agent);
* tool calls and their results become ``tool_payload`` events (call ids of sub-agents and
  continuations are namespaced), linked through ``emitted_tool_call_ids`` and the next
  call's ``consumed_tool_call_ids``;
* steps without token IDs: when the execution has no captured token IDs at all, they are
  rebuilt with the Qwen3 chat template and tokenizer (:mod:`ledger.producers.chatml`) and recorded as
  ``reconstructed: true`` (never targets); when other steps carry IDs from the agent's own
  tokenizer, no faithful IDs can be built for them and they are **skipped** (counted).
  Copied-context steps (``is_copied_context``) and non-LLM dispatches
  (``llm_call_count == 0``) are context, not calls;
* a step's ``extra["ledger"]`` (written by ``ledger export-atif``) keeps its ``generator``,
  ``reconstructed`` and ``turn_kind``; such a step that is not a policy output (or is
  reconstructed) may carry token IDs without log-probs.

The harbor-golden files ship flattened (``X.trajectory.json`` referring to
``trajectory.summarization-1-summary.json`` lives beside it as
``X.trajectory.summarization-1-summary.json``); a ref that does not exist as written is
also tried with the referring file's ``X.`` prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from atif import Trajectory

from ledger.algorithms.canonical import DuplicateKeyError, loads_unique
from ledger.algorithms.prefix_match import common_prefix, tokens_sha256
from ledger.events.validate import ValidationError
from ledger.producers.ingest import IngestError, Ingestor
from ledger.producers import chatml

__all__ = ["atif_events", "import_atif", "load_trajectory"]

DEFAULT_DEADLINE = "9999-12-31T23:59:59Z"
"""Imported runs are historical: their budget never expires unless a deadline is given."""
MIN_PREFIX = 16


def load_trajectory(path: str | Path) -> Trajectory:
    """One ATIF file; a JSON object naming a key twice is refused (SPEC 11.7), naming file and key."""
    try:
        doc = loads_unique(Path(path).read_text(encoding="utf-8"))
    except DuplicateKeyError as exc:
        raise ValidationError(f"{Path(path).name}: {exc}") from None
    return Trajectory.model_validate(doc)


def _text(message: Any) -> str | None:
    """Plain text of a step message / result content; None if it has non-text parts."""
    if message is None:
        return ""
    if isinstance(message, str):
        return message
    parts = []
    for part in message:
        if part.type != "text":
            return None
        parts.append(part.text or "")
    return "".join(parts)


def _resolve(ref_path: str, referrer: Path, chain: Sequence[Path]) -> Path | None:
    """A file ref, relative to the referring file (or with a flattened ``X.`` prefix)."""
    direct = (referrer.parent / ref_path)
    if direct.is_file():
        return direct.resolve()
    for f in chain:
        name = f.name
        if ".trajectory" in name:
            cand = f.parent / (name[: name.index(".trajectory")] + "." + ref_path)
            if cand.is_file():
                return cand.resolve()
    return None


def _has_ids(traj: Trajectory) -> bool:
    return any(s.metrics is not None and s.metrics.prompt_token_ids and s.metrics.completion_token_ids is not None
               for s in traj.steps)


@dataclass
class _Segment:
    traj: Trajectory
    path: Path | None  # file it came from (None: embedded)
    seg: str  # request-id prefix
    agent_id: str
    tier: str
    kind: str
    parent_request_id: str | None
    chain: tuple[Path, ...]  # referring files, nearest first


@dataclass
class _Build:
    execution_id: str
    reconstruct: bool
    events: list[dict] = field(default_factory=list)
    requests: int = 0
    reconstructed: int = 0
    skipped: int = 0
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    copied_context: int = 0
    tool_payloads: int = 0
    unresolved: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    subagents: int = 0
    last_main: str | None = None
    prev: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)  # agent -> (request, path)
    paths: dict[str, np.ndarray] = field(default_factory=dict)
    payload_keys: set = field(default_factory=set)

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skipped_reasons[reason] = self.skipped_reasons.get(reason, 0) + 1


def _collect(traj: Trajectory, path: Path | None, chain: tuple[Path, ...], seen: set) -> Iterable[tuple[Trajectory, Path | None]]:
    """Every trajectory reachable from ``traj`` (for the has-token-IDs decision)."""
    yield traj, path
    embedded = {t.trajectory_id: t for t in traj.subagent_trajectories or ()}
    refs = []
    for step in traj.steps:
        for res in (step.observation.results if step.observation else ()):
            refs.extend(res.subagent_trajectory_ref or ())
    for ref in refs:
        if ref.trajectory_id in embedded:
            yield from _collect(embedded[ref.trajectory_id], path, chain, seen)
        elif ref.trajectory_path and path is not None:
            p = _resolve(ref.trajectory_path, path, (path, *chain))
            if p is not None and p not in seen:
                seen.add(p)
                yield from _collect(load_trajectory(p), p, (path, *chain), seen)
    if traj.continued_trajectory_ref and path is not None:
        p = _resolve(traj.continued_trajectory_ref, path, (path, *chain))
        if p is not None and p not in seen:
            seen.add(p)
            yield from _collect(load_trajectory(p), p, (path, *chain), seen)


def referenced_files(path: str | Path) -> set[Path]:
    """Files a trajectory file refers to (sub-agents, continuations), transitively."""
    p = Path(path).resolve()
    seen: set[Path] = {p}
    list(_collect(load_trajectory(p), p, (), seen))
    return seen - {p}


def _build(path: Path, *, execution_id: str | None, task_id: str | None, deadline: str, status: str | None,
           reconstruct: str) -> _Build:
    root = load_trajectory(path)
    doc_id = root.trajectory_id or root.session_id or "trajectory"
    stem = path.name[:-5] if path.name.endswith(".json") else path.name
    exported = ((root.extra or {}).get("ledger") or {}).get("execution_id")  # a `ledger export-atif` root
    if isinstance(exported, str) and exported:
        exid = execution_id or f"atif:{exported}"
    else:
        exid = execution_id or f"atif:{doc_id}:{stem}"
    captured = any(_has_ids(t) for t, _ in _collect(root, path, (), {path}))
    b = _Build(exid, reconstruct == "auto" and not captured)
    agent = root.agent
    extra = root.extra or {}
    tokenizer = None
    if b.reconstruct:

        tokenizer = chatml.TOKENIZER_NAME
    b.events.append({
        "type": "execution_opened", "execution_id": exid, "task_id": task_id or str(extra.get("task_id") or f"atif:{stem}"),
        "deadline": deadline, "policy": agent.model_name or f"{agent.name}@{agent.version}",
        **({"tokenizer": tokenizer} if tokenizer else {}),
        "metadata": {"atif": {"file": path.name, "schema_version": root.schema_version, "session_id": root.session_id,
                              "trajectory_id": root.trajectory_id,
                              "agent": {"name": agent.name, "version": agent.version, "model_name": agent.model_name}},
                     "token_ids": "captured" if captured else ("reconstructed" if b.reconstruct else "none")},
    })
    _segment(b, _Segment(root, path, "main", "main", "main", "task", None, ()), seen={path})
    close_status = status or (extra.get("status") if extra.get("status") in ("completed", "timeout", "error", "cancelled")
                              else "completed")
    b.events.append({"type": "execution_closed", "execution_id": exid, "status": close_status})
    return b


def _segment(b: _Build, s: _Segment, seen: set) -> None:
    traj = s.traj
    if s.path is not None:
        b.files.append(s.path.name)
    embedded = {t.trajectory_id: t for t in traj.subagent_trajectories or ()}
    history: list[dict] = []
    pending_consumed: list[str] = []
    n_sub = 0
    first_call = True
    for step in traj.steps:
        text = _text(step.message)
        if step.source in ("system", "user"):
            if text:
                history.append({"role": step.source, "content": text})
        elif step.is_copied_context or step.llm_call_count == 0:
            b.copied_context += bool(step.is_copied_context)
            history.append(_assistant(step, text))
            _observe(b, s, step, history, pending_consumed, record=False)
        else:
            rid = f"{s.seg}/step-{step.step_id}"
            emitted = [_call_id(s, tc.tool_call_id) for tc in step.tool_calls or ()]
            made = _request(b, s, step, rid, history, text, pending_consumed, emitted,
                            s.parent_request_id if first_call else None)
            if made:
                first_call = False
                pending_consumed.clear()
                if s.agent_id == "main":
                    b.last_main = rid
                for tc, cid in zip(step.tool_calls or (), emitted):
                    _payload(b, cid, "call", {"function_name": tc.function_name, "arguments": tc.arguments})
            history.append(_assistant(step, text))
            _observe(b, s, step, history, pending_consumed, record=made)
        # delegated work reported in this step's observation
        for res in (step.observation.results if step.observation else ()):
            for ref in res.subagent_trajectory_ref or ():
                sub_traj, sub_path = None, None
                if ref.trajectory_id is not None and ref.trajectory_id in embedded:
                    sub_traj, sub_path = embedded[ref.trajectory_id], s.path
                elif ref.trajectory_path and s.path is not None:
                    sub_path = _resolve(ref.trajectory_path, s.path, (s.path, *s.chain))
                    if sub_path is not None and sub_path not in seen:
                        seen.add(sub_path)
                        sub_traj = load_trajectory(sub_path)
                if sub_traj is None:
                    b.unresolved.append(f"{s.path.name if s.path else s.seg}: {ref.trajectory_path or ref.trajectory_id}")
                    continue
                n_sub += 1
                b.subagents += 1
                label = f"{s.seg}.sub{n_sub}" if s.seg != "main" else f"sub{n_sub}"
                summary = any("summar" in (x or "").lower() for x in (
                    sub_traj.agent.name, ref.trajectory_path, json.dumps((ref.extra or {}), default=str),
                    json.dumps(sub_traj.agent.extra or {}, default=str)))
                _segment(b, _Segment(sub_traj, sub_path, label, f"{label}:{sub_traj.agent.name}", "sub",
                                     "summary" if summary else "task", b.last_main if s.agent_id == "main" else None,
                                     (s.path, *s.chain) if s.path else s.chain), seen)
    if traj.continued_trajectory_ref and s.path is not None:
        nxt = _resolve(traj.continued_trajectory_ref, s.path, (s.path, *s.chain))
        if nxt is None or nxt in seen:
            if nxt is None:
                b.unresolved.append(f"{s.path.name}: {traj.continued_trajectory_ref}")
            return
        seen.add(nxt)
        idx = s.seg.count(".cont") + 1
        _segment(b, _Segment(load_trajectory(nxt), nxt, f"{s.seg}.cont{idx}", s.agent_id, s.tier, s.kind, None,
                             (s.path, *s.chain)), seen)


def _call_id(s: _Segment, tool_call_id: str) -> str:
    return tool_call_id if s.seg == "main" else f"{s.seg}/{tool_call_id}"


def _assistant(step: Any, text: str | None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": text or ""}
    if step.reasoning_content:
        msg["reasoning_content"] = step.reasoning_content
    if step.tool_calls:
        msg["tool_calls"] = [{"name": tc.function_name, "arguments": tc.arguments} for tc in step.tool_calls]
    return msg


def _observe(b: _Build, s: _Segment, step: Any, history: list[dict], pending: list[str], *, record: bool) -> None:
    """Append the step's observation to the history; cache tool results (when recorded)."""
    results = [r for r in (step.observation.results if step.observation else ()) if not r.subagent_trajectory_ref]
    calls = [tc.tool_call_id for tc in step.tool_calls or ()]
    for res in results:
        content = _text(res.content)
        source = res.source_call_id or (calls[0] if len(calls) == 1 and len(results) == 1 else None)
        if source is not None:
            history.append({"role": "tool", "content": content or ""})
            if record:
                cid = _call_id(s, source)
                _payload(b, cid, "result", {"content": content if content is not None else "[non-text content]"})
                pending.append(cid)
        else:
            history.append({"role": "user", "content": content or ""})


def _payload(b: _Build, call_id: str, kind: str, payload: Any) -> None:
    if (call_id, kind) in b.payload_keys:
        return
    b.payload_keys.add((call_id, kind))
    b.tool_payloads += 1
    b.events.append({"type": "tool_payload", "execution_id": b.execution_id, "call_id": call_id, "kind": kind,
                     "payload": payload})


def _ledger_origin(step: Any) -> dict:
    """The provenance a ledger export (``ledger export-atif``) keeps in ``step.extra["ledger"]``:
    ``generator``, ``reconstructed``, ``turn_kind`` (only well-formed values; others ignored)."""
    info = (step.extra or {}).get("ledger")
    if not isinstance(info, dict):
        return {}
    out: dict[str, Any] = {}
    if info.get("generator") in ("policy", "evaluator", "harness", "human"):
        out["generator"] = info["generator"]
    if isinstance(info.get("reconstructed"), bool):
        out["reconstructed"] = info["reconstructed"]
    if info.get("turn_kind") in ("task", "summary"):
        out["turn_kind"] = info["turn_kind"]
    return out


def _request(b: _Build, s: _Segment, step: Any, rid: str, history: list[dict], text: str | None,
             consumed: list[str], emitted: list[str], parent: str | None) -> bool:
    m = step.metrics
    origin = _ledger_origin(step)
    reconstructed = bool(origin.get("reconstructed", False))
    logprobs = None
    if m is not None and m.prompt_token_ids and m.completion_token_ids is not None:
        inp = [int(x) for x in m.prompt_token_ids]
        out = [int(x) for x in m.completion_token_ids]
        if m.logprobs is None and (reconstructed or origin.get("generator", "policy") != "policy"):
            pass  # a ledger export of an output that carries no behaviour log-probs
        elif m.logprobs is None or len(m.logprobs) != len(out):
            b.skip("captured token IDs without matching logprobs")
            return False
        else:
            logprobs = [float(x) for x in m.logprobs]
    elif b.reconstruct:
        if text is None or any(msg.get("content") is None for msg in history):
            b.skip("non-text content cannot be rendered")
            return False

        msgs = [dict(msg) for msg in history]
        if not msgs:
            b.skip("no context to render")
            return False
        tools = [t for t in (s.traj.agent.tool_definitions or ())] or None
        inp = chatml.render_prompt(msgs, tools)
        out = chatml.render_output(_assistant(step, text))
        reconstructed = True
    else:
        b.skip("no token IDs (the agent's tokenizer is not available)")
        return False
    # prefix reference against this agent's previous call (or the parent call)
    new = np.asarray(inp, dtype=np.uint32)
    line: dict[str, Any] = {"type": "request", "execution_id": b.execution_id, "request_id": rid}
    best_len, best = 0, None
    for cand in (b.prev.get(s.agent_id), (parent, b.paths[parent]) if parent in b.paths else None):
        if cand is None:
            continue
        n = common_prefix(cand[1], new)
        if n > best_len:
            best_len, best = n, cand
    if best is not None and best_len >= MIN_PREFIX:
        line["input_prefix"] = {"request_id": best[0], "length": best_len, "sha256": tokens_sha256(best[1][:best_len])}
        line["input_suffix_ids"] = inp[best_len:]
    else:
        line["input_ids"] = inp
    line["output_ids"] = out
    if logprobs is not None:
        line["output_logprobs"] = logprobs
    line.update({"agent_id": s.agent_id, "agent_tier": s.tier, "turn_kind": origin.get("turn_kind", s.kind),
                 "generator": origin.get("generator", "policy"), "reconstructed": reconstructed,
                 "consumed_tool_call_ids": list(consumed), "emitted_tool_call_ids": emitted})
    if parent is not None:
        line["parent_request_id"] = parent
    model = step.model_name or s.traj.agent.model_name
    if model:
        line["model"] = model
    path = np.concatenate((new, np.asarray(out, dtype=np.uint32)))
    b.prev[s.agent_id] = (rid, path)
    b.paths[rid] = path
    b.events.append(line)
    b.requests += 1
    b.reconstructed += reconstructed
    return True


def atif_events(path: str | Path, *, execution_id: str | None = None, task_id: str | None = None,
                deadline: str = DEFAULT_DEADLINE, status: str | None = None, reconstruct: str = "auto") -> list[dict]:
    """The JSON-lines events (SPEC §7.1 dicts) of one root trajectory file and everything it
    references.  ``reconstruct``: ``"auto"`` (rebuild IDs with the Qwen chat template only
    for executions without any captured IDs) or ``"never"``."""
    return _build(Path(path).resolve(), execution_id=execution_id, task_id=task_id, deadline=deadline,
                  status=status, reconstruct=reconstruct).events


def import_atif(paths: Iterable[str | Path], ingestor: Ingestor, *, deadline: str = DEFAULT_DEADLINE,
                status: str | None = None, reconstruct: str = "auto") -> dict:
    """Import ATIF files; one execution per root trajectory, appended atomically each.

    Files referenced by another file of ``paths`` (sub-agents, continuations) are imported
    through their root, not twice.  Returns the summary the CLI prints: executions,
    requests, reconstructed, skipped (+ reasons), tool payloads, unresolved refs, appended,
    duplicates, conflicting.
    """
    files = [Path(p).resolve() for p in paths]
    referenced: set[Path] = set()
    for f in files:
        referenced |= referenced_files(f)
    roots = [f for f in dict.fromkeys(files) if f not in referenced]
    summary: dict[str, Any] = {"files": len(files), "executions": 0, "requests": 0, "reconstructed": 0, "skipped": 0,
                               "skipped_reasons": {}, "tool_payloads": 0, "subagents": 0, "copied_context_steps": 0,
                               "unresolved_refs": [], "appended": 0, "duplicates": 0, "conflicting": 0,
                               "conflicts": [], "execution_ids": []}
    for f in roots:
        b = _build(f, execution_id=None, task_id=None, deadline=deadline, status=status, reconstruct=reconstruct)
        try:
            report = ingestor.ingest_lines(list(enumerate(b.events, 1)))
        except IngestError as exc:
            raise IngestError([f"{f.name}: {e}" for e in exc.errors]) from None
        summary["executions"] += 1
        summary["execution_ids"].append(b.execution_id)
        summary["requests"] += b.requests
        summary["reconstructed"] += b.reconstructed
        summary["skipped"] += b.skipped
        for k, v in b.skipped_reasons.items():
            summary["skipped_reasons"][k] = summary["skipped_reasons"].get(k, 0) + v
        summary["tool_payloads"] += b.tool_payloads
        summary["subagents"] += b.subagents
        summary["copied_context_steps"] += b.copied_context
        summary["unresolved_refs"].extend(b.unresolved)
        summary["appended"] += report.appended
        summary["duplicates"] += report.duplicates
        summary["conflicting"] += len(report.conflicts)
        summary["conflicts"].extend(report.conflicts)
    return summary
