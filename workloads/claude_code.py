"""Convert real Claude Code sessions into token-level execution events.

A Claude Code session directory holds ``<session>.jsonl`` (the main agent),
``<session>/subagents/agent-*.jsonl`` (delegated sub-agents, ``isSidechain``) and
``agent-acompact-*.jsonl`` (the compaction call that summarised the main history). The
files are message-level; this module replays them the way a Qwen-based harness would have
run the same conversation and renders every model call through :mod:`ledger.producers.chatml`:

* one model call = the assistant lines sharing ``message.id`` (thinking, text and tool_use
  blocks, possibly interleaved with results of tools that already ran);
* its input = the conversation so far (system prompt with the tool schemas, user messages,
  earlier calls, tool results) plus the generation prompt; its output = the call's blocks
  rendered as ``<think>…</think>``, text and ``<tool_call>`` JSON, ending in ``<|im_end|>``;
* hook context that Claude Code attached after tool results (recorded only in the
  compaction file) is appended to the matching tool response; queued user messages that
  were delivered mid-turn become user messages;
* ``progress`` lines that echo a sub-agent are used only when its ``subagents/`` file is
  missing (never counted twice);
* at ``compact_boundary`` the compaction call (``turn_kind`` ``summary``) sees the whole
  history plus the summarisation prompt; afterwards the summary message replaces it.

The transcripts carry no token IDs and no log-probs: every request is marked
``reconstructed: true`` (its IDs were re-derived from messages, so it is never a training
target), ``generator`` is ``policy`` and ``output_logprobs`` is absent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterable, Iterator

from ledger.producers import chatml

Line = dict[str, Any]

COLLECTION_RUN = "claude-code-transcripts"
_COMMIT = re.compile(r"^\[[^\]\s]+(?: \(root-commit\))? ([0-9a-f]{7,40})\]", re.MULTILINE)

_DESCRIPTIONS = {
    "Bash": "Run a shell command in the working directory and return stdout/stderr.",
    "Read": "Read a file from the local filesystem; output lines are numbered.",
    "Edit": "Replace an exact string in a file (old_string must be unique unless replace_all).",
    "Write": "Write a file, replacing any existing content.",
    "Glob": "Find files by glob pattern, newest first.",
    "Grep": "Search file contents with a regular expression (ripgrep).",
    "Task": "Launch a sub-agent with its own context for a multi-step task; returns its report.",
    "TaskOutput": "Read the output of a background task.",
    "WebFetch": "Fetch a URL and answer a prompt about its content.",
    "WebSearch": "Search the web and return result snippets.",
    "AskUserQuestion": "Ask the user multiple-choice questions and wait for the answers.",
    "ExitPlanMode": "Leave plan mode after presenting the plan to the user.",
    "TodoWrite": "Create or update the session's todo list.",
}
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number",
               list: "array", dict: "object"}


def list_sessions(root: str | Path) -> list[Path]:
    """The main-session files (``*.jsonl`` directly under ``root``), sorted by name."""
    return sorted(Path(root).glob("*.jsonl"))


def _read(path: Path) -> list[Line]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _rfc3339(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _text(content: Any) -> str:
    """Text of a message or tool_result content (string or list of blocks)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or ():
        if block.get("type") == "text":
            parts.append(block["text"])
        elif block.get("type") == "image":
            parts.append("[image]")
    return "\n\n".join(parts)


def _tool_schemas(uses: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Function schemas inferred from the tool calls an agent made (sorted by name)."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for name, arguments in uses:
        seen.setdefault(name, []).append(arguments)
    tools = []
    for name in sorted(seen):
        calls = seen[name]
        properties: dict[str, dict[str, str]] = {}
        for arguments in calls:
            for key, value in arguments.items():
                properties.setdefault(key, {"type": _JSON_TYPES.get(type(value), "string")})
        required = [key for key in properties if all(key in args for args in calls)]
        tools.append({"type": "function", "function": {
            "name": name,
            "description": _DESCRIPTIONS.get(name, f"The {name} tool of the harness."),
            "parameters": {"type": "object", "properties": properties,
                           "required": required}}})
    return tools


def _assistant_message(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One model call's content blocks as a chat message (thinking first, as Qwen emits)."""
    reasoning = "\n\n".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    content = ""
    for block in blocks:
        if block["type"] == "text":
            if content.strip() and block["text"].strip():
                content += "\n\n"
            content += block["text"]
    message: dict[str, Any] = {"role": "assistant", "content": content,
                               "reasoning_content": reasoning}
    calls = [{"id": b["id"], "name": b["name"], "arguments": b["input"]}
             for b in blocks if b["type"] == "tool_use"]
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass
class _Call:
    """A model call being assembled from assistant lines."""

    message_id: str
    model: str
    input_ids: list[int]
    consumed: list[str]
    parent: str | None
    blocks: list[dict[str, Any]] = field(default_factory=list)
    stamp: str = ""


@dataclass
class _Group:
    """Events that belong together in time: consumed results, the request, emitted calls."""

    stamp: str
    order: int
    events: list[dict[str, Any]]


class _Agent:
    """Replays one agent's transcript lines as a harness would, producing event groups."""

    def __init__(self, execution_id: str, agent_id: str, tier: str, system: str,
                 tools: list[dict[str, Any]], order: int,
                 reminders: dict[str, list[str]] | None = None) -> None:
        self.execution_id = execution_id
        self.agent_id = agent_id
        self.tier = tier
        self.tools = tools
        self.order = order
        self.reminders = reminders or {}
        self.history: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.open: _Call | None = None
        self.buffer: list[tuple[str, Any, str]] = []
        self.pending: list[dict[str, Any]] = []  # result payloads not yet consumed
        self.last_request: str | None = None
        self.groups: list[_Group] = []

    # -- input side ---------------------------------------------------------------------

    def user(self, text: str, stamp: str) -> None:
        self._user_side(("user", text, stamp))

    def tool_result(self, tool_use_id: str, content: str, is_error: bool, stamp: str) -> None:
        self._user_side(("tool", (tool_use_id, content, is_error), stamp))

    def _user_side(self, item: tuple[str, Any, str]) -> None:
        if self.open is None:
            self._apply(item)
        else:
            self.buffer.append(item)

    def _apply(self, item: tuple[str, Any, str]) -> None:
        kind, value, stamp = item
        if kind == "user":
            self.history.append({"role": "user", "content": value})
            return
        tool_use_id, content, is_error = value
        extra = self.reminders.get(tool_use_id, [])
        self.history.append({"role": "tool", "content": "\n\n".join([content, *extra])})
        self.pending.append({"type": "tool_payload", "execution_id": self.execution_id,
                             "call_id": tool_use_id, "kind": "result",
                             "payload": {"content": content, "is_error": is_error},
                             "occurred_at": stamp})

    # -- output side --------------------------------------------------------------------

    def assistant(self, line: Line, stamp: str) -> None:
        message = line["message"]
        if self.open is None or self.open.message_id != message["id"]:
            self.close()
            self.open = self._start(message["id"], message.get("model", ""))
        self.open.blocks.extend(message["content"])
        self.open.stamp = stamp

    def _start(self, message_id: str, model: str) -> _Call:
        consumed = [event["call_id"] for event in self.pending]
        return _Call(message_id, model, chatml.render_prompt(self.history, self.tools),
                     consumed, self.last_request)

    def close(self, turn_kind: str = "task") -> None:
        """Finish the open call: record it, then apply what arrived while it streamed."""
        call, self.open = self.open, None
        if call is None:
            return
        message = _assistant_message(call.blocks)
        self.history.append(message)
        emitted = [c["id"] for c in message.get("tool_calls", ())]
        request = {
            "type": "request", "execution_id": self.execution_id,
            "request_id": call.message_id, "input_ids": call.input_ids,
            "output_ids": chatml.render_output(message), "agent_id": self.agent_id,
            "agent_tier": self.tier, "turn_kind": turn_kind, "generator": "policy",
            "reconstructed": True, "consumed_tool_call_ids": call.consumed,
            "emitted_tool_call_ids": emitted, "model": call.model,
            "finish_reason": "tool_calls" if emitted else "stop", "occurred_at": call.stamp,
        }
        if call.parent is not None:
            request["parent_request_id"] = call.parent
        calls = [{"type": "tool_payload", "execution_id": self.execution_id,
                  "call_id": c["id"], "kind": "call", "occurred_at": call.stamp,
                  "payload": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in message.get("tool_calls", ())]
        consumed = set(call.consumed)
        before = [event for event in self.pending if event["call_id"] in consumed]
        self.pending = [event for event in self.pending if event["call_id"] not in consumed]
        self.groups.append(_Group(call.stamp, self.order, before + [request] + calls))
        self.last_request = call.message_id
        order = {call_id: index for index, call_id in enumerate(emitted)}
        buffered, self.buffer = self.buffer, []
        tools = sorted((item for item in buffered if item[0] == "tool"),
                       key=lambda item: order.get(item[1][0], len(order)))
        for item in tools + [item for item in buffered if item[0] != "tool"]:
            self._apply(item)

    def compaction(self, prompt: str, line: Line, stamp: str) -> None:
        """The summarisation call: the whole history plus ``prompt``."""
        self.close()
        self.history.append({"role": "user", "content": prompt})
        self.open = self._start(line["message"]["id"], line["message"].get("model", ""))
        self.open.blocks.extend(line["message"]["content"])
        self.open.stamp = stamp
        self.close(turn_kind="summary")

    def restart(self, summary: str) -> None:
        """Compaction replaced the history with ``summary`` (the system prompt stays)."""
        self.close()
        self.history = [self.history[0], {"role": "user", "content": summary}]
        self.last_request = None

    def finish(self) -> list[_Group]:
        """All groups, stamps made non-decreasing so merging keeps this agent's order."""
        self.close()
        if self.pending:
            self.groups.append(_Group(self.pending[-1]["occurred_at"], self.order, self.pending))
            self.pending = []
        latest = ""
        for group in self.groups:
            latest = group.stamp = max(latest, group.stamp)
        return self.groups


def _system_prompt(meta: Line, role: str) -> str:
    return (f"{role}\n\n# Working rules\n"
            "- Read files before editing them; keep edits minimal and in the project's style.\n"
            "- Verify changes with the project's tests, compiler and linters.\n"
            "- Use the tools for all file and shell access; report results concisely.\n\n"
            f"# Environment\n- Working directory: {meta.get('cwd', '')}\n"
            f"- Git branch: {meta.get('gitBranch', '')}\n- Platform: linux\n"
            f"- Date: {meta.get('timestamp', '')[:10]}")


def _tool_uses(lines: Iterable[Line]) -> Iterator[tuple[str, dict[str, Any]]]:
    for line in lines:
        if line.get("type") == "assistant":
            for block in line["message"]["content"]:
                if block["type"] == "tool_use":
                    yield block["name"], block["input"]


def _replay(agent: _Agent, lines: Iterable[Line]) -> None:
    """Feed ``user`` and ``assistant`` lines of a sub-agent (or compaction-free) stream."""
    for line in lines:
        stamp = line.get("timestamp", "")
        if line.get("type") == "assistant":
            agent.assistant(line, stamp)
        elif line.get("type") == "user":
            _feed_user(agent, line, stamp)


def _feed_user(agent: _Agent, line: Line, stamp: str) -> None:
    content = line["message"]["content"]
    if isinstance(content, str):
        agent.user(content, stamp)
        return
    texts = []
    for block in content:
        if block["type"] == "tool_result":
            agent.tool_result(block["tool_use_id"], _text(block.get("content")),
                              bool(block.get("is_error")), stamp)
        else:
            texts.append(_text([block]))
    if texts:
        agent.user("\n\n".join(texts), stamp)


def _subagent_lines(session: Path, main: list[Line]) -> dict[str, list[Line]]:
    """Sub-agent transcripts by agent id: ``subagents/`` files, else echoed progress lines."""
    found: dict[str, list[Line]] = {}
    folder = session.with_suffix("") / "subagents"
    for path in sorted(folder.glob("agent-*.jsonl")):
        if not path.name.startswith("agent-acompact-"):
            found[path.stem.removeprefix("agent-")] = _read(path)
    echoed: dict[str, list[Line]] = {}
    seen: set[str] = set()
    for line in main:
        data = line.get("data") or {}
        if line.get("type") != "progress" or data.get("type") != "agent_progress":
            continue
        agent_id, message = data.get("agentId"), data.get("message") or {}
        uuid = message.get("uuid")
        if agent_id in found or (uuid is not None and uuid in seen):
            continue
        seen.add(uuid)
        echoed.setdefault(agent_id, []).append(
            dict(message, timestamp=message.get("timestamp") or line.get("timestamp", "")))
    return found | echoed


def _spawning_calls(main: list[Line],
                    subagents: dict[str, list[Line]]) -> dict[str, dict[str, Any]]:
    """The ``Task`` tool call that started each sub-agent (by progress line, else prompt)."""
    tasks = {block["id"]: block["input"] for line in main if line.get("type") == "assistant"
             for block in line["message"]["content"]
             if block["type"] == "tool_use" and block["name"] in ("Task", "Agent")}
    by_agent: dict[str, dict[str, Any]] = {}
    for line in main:
        data = line.get("data") or {}
        if data.get("type") == "agent_progress" and line.get("parentToolUseID") in tasks:
            by_agent.setdefault(data["agentId"], tasks[line["parentToolUseID"]])
    for agent_id, lines in subagents.items():
        if agent_id not in by_agent:
            first = next((_text(l["message"]["content"]) for l in lines
                          if l.get("type") == "user"), "")
            by_agent[agent_id] = next((t for t in tasks.values() if t.get("prompt") == first), {})
    return by_agent


def _compactions(session: Path) -> list[tuple[Line, str, dict[str, list[str]]]]:
    """(assistant line, summarisation prompt, hook reminders by parent uuid) per file."""
    out = []
    for path in sorted((session.with_suffix("") / "subagents").glob("agent-acompact-*.jsonl")):
        lines = _read(path)
        reminders: dict[str, list[str]] = {}
        prompt, answer = "", None
        for line in lines:
            if line.get("type") == "assistant":
                answer = line
            elif line.get("type") == "user" and line.get("isMeta"):
                reminders.setdefault(line["parentUuid"], []).append(
                    _text(line["message"]["content"]))
            elif line.get("type") == "user":
                prompt = _text(line["message"]["content"])
        if answer is not None:
            out.append((answer, prompt, reminders))
    return out


def _reminders_by_tool(main: list[Line], by_parent: dict[str, list[str]]) -> dict[str, list[str]]:
    """Re-key hook reminders from their parent line to the tool call they follow."""
    out: dict[str, list[str]] = {}
    for line in main:
        texts = by_parent.get(line.get("uuid", ""))
        if not texts or not isinstance((line.get("message") or {}).get("content"), list):
            continue
        ids = [b.get("tool_use_id") or b.get("id") for b in line["message"]["content"]
               if b["type"] in ("tool_result", "tool_use")]
        if ids:
            out.setdefault(ids[-1], []).extend(texts)
    return out


def _merge(groups: list[_Group]) -> list[dict[str, Any]]:
    """Events of all agents in time order, with non-decreasing ``occurred_at``."""
    events = []
    latest: datetime | None = None
    for group in sorted(groups, key=lambda g: (_time(g.stamp), g.order)):
        for event in group.events:
            moment = _time(event["occurred_at"])
            latest = moment if latest is None or moment > latest else latest
            event["occurred_at"] = _rfc3339(latest)
            events.append(event)
    return events


def session_events(session_path: str | Path, execution_id: str | None = None,
                   task_id: str | None = None) -> list[dict[str, Any]]:
    """All events of one Claude Code session as a reconstructed execution.

    Main agent, every sub-agent (``agent_tier`` ``sub``, ``agent_id`` ``agent-<id>``) and the
    compaction call (``turn_kind`` ``summary``) become ``request`` events of one execution,
    with ``tool_payload`` events for every call and result, framed by ``execution_opened``
    and ``execution_closed`` (artifact versions = commits the session created).
    """
    session = Path(session_path)
    execution_id = execution_id or f"claude-code-{session.stem}"
    task_id = task_id or f"claude-code-task-{session.stem}"
    main = _read(session)
    meta = next(line for line in main if line.get("type") in ("user", "assistant"))
    subagents = _subagent_lines(session, main)
    spawners = _spawning_calls(main, subagents)
    compactions = _compactions(session)
    reminders: dict[str, list[str]] = {}
    for _, _, by_parent in compactions:
        for tool_id, texts in _reminders_by_tool(main, by_parent).items():
            reminders.setdefault(tool_id, []).extend(texts)
    agent = _Agent(execution_id, "main", "main", _system_prompt(
        meta, "You are a coding agent working in the user's terminal on their repository. You "
        "read and change code, run commands and tests, and manage the project's issue "
        "tracker."), _tool_schemas(_tool_uses(main)), 0, reminders)
    queued: list[str] = []
    pending_compactions = list(compactions)
    for line in main:
        kind, stamp = line.get("type"), line.get("timestamp", "")
        if kind == "assistant":
            agent.assistant(line, stamp)
        elif kind == "user" and line.get("isCompactSummary"):
            agent.restart(_text(line["message"]["content"]))
        elif kind == "user":
            content = line["message"]["content"]
            if isinstance(content, str) and content in queued:
                queued.remove(content)
            _feed_user(agent, line, stamp)
        elif kind == "system" and line.get("subtype") == "compact_boundary":
            if pending_compactions:
                answer, prompt, _ = pending_compactions.pop(0)
                agent.compaction(prompt, answer, answer.get("timestamp", stamp))
        elif kind == "queue-operation" and line.get("operation") == "enqueue":
            queued.append(line.get("content", ""))
        elif kind == "queue-operation" and line.get("operation") == "remove" and queued:
            text = queued.pop()  # delivered mid-turn; slash commands run locally instead
            if not text.startswith("/"):
                agent.user(text, stamp)
    groups = agent.finish()
    models = {line["message"].get("model") for line in main if line.get("type") == "assistant"}
    for order, (agent_id, lines) in enumerate(sorted(subagents.items()), start=1):
        spawn = spawners.get(agent_id, {})
        role = (f"You are a {spawn.get('subagent_type', 'general-purpose')} sub-agent started "
                f"by a coding agent for the task \"{spawn.get('description', 'delegated work')}\"."
                " Work autonomously with the tools provided and finish with a concise report; "
                "the report is returned to the calling agent.")
        sub = _Agent(execution_id, f"agent-{agent_id}", "sub", _system_prompt(meta, role),
                     _tool_schemas(_tool_uses(lines)), order)
        _replay(sub, lines)
        groups += sub.finish()
    events = _merge(groups)
    start = _time(meta["timestamp"])
    shell_calls = {event["call_id"] for event in events if event["type"] == "tool_payload"
                   and event["kind"] == "call" and event["payload"]["name"] == "Bash"}
    commits = [sha for event in events if event["type"] == "tool_payload"
               and event["kind"] == "result" and event["call_id"] in shell_calls
               for sha in _COMMIT.findall(event["payload"]["content"])]
    last = events[-1]["occurred_at"] if events else meta["timestamp"]
    opened = {
        "type": "execution_opened", "execution_id": execution_id, "task_id": task_id,
        "deadline": _rfc3339(start + timedelta(hours=24)),
        "policy": "anthropic/" + "+".join(sorted(m for m in models if m)),
        "tokenizer": chatml.TOKENIZER_NAME, "origin": "production",
        "collection_run_id": COLLECTION_RUN, "occurred_at": _rfc3339(start),
        "metadata": {"source": "claude-code", "session_id": meta.get("sessionId"),
                     "claude_code_version": meta.get("version"), "cwd": meta.get("cwd"),
                     "git_branch": meta.get("gitBranch"), "rendering": "chatml/qwen3",
                     "reconstructed": True},
    }
    closed = {"type": "execution_closed", "execution_id": execution_id, "status": "completed",
              "artifact_versions": list(dict.fromkeys(commits)), "occurred_at": last}
    return [opened, *events, closed]
