"""A chat request body's digest and UTF-8 check, O(new messages) per turn (issue 29).

The digest is SHA-256 of the body's canonical JSON (sorted keys, no spaces, UTF-8, lone surrogates passed through):
one ``json.dumps`` of the body.  It is kept in gateway.db and compared with a retried request id's body across
restarts, so its meaning never changes.  The text is built from three parts: the body before its messages' ``[``
(every key that sorts before ``"messages"``), each message's canonical JSON (cached per message), and the body after
the messages' ``]``.  SHA-256 states after ``head + "[" + m1 + "," + ... + mk`` are kept, so a growing history hashes
only its new messages and the tail; the UTF-8 verdict of each message's JSON is cached with it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Mapping, Sequence

STATES_KEPT = 1024  # SHA-256 states of histories (the latest of each session in flight is the one reused)

_states: OrderedDict[tuple[int, int], tuple[str, tuple[str, ...], Any]] = OrderedDict()
_states_lock = threading.Lock()


def body_digest(body: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a request body's canonical JSON text (see the module's docstring): a retried request id
    must carry the same body."""
    parts = body_parts(body)
    if parts is None:
        return hashlib.sha256(_encode(_canonical(body))).hexdigest()
    head, msgs, tail = parts
    sha = _history_sha(head, msgs)
    sha.update(_encode("]" + tail))
    return sha.hexdigest()


def body_text(body: Mapping[str, Any]) -> str:
    """The body's canonical JSON text (one ``json.dumps`` of it), each message's from the cache: the reference
    of :func:`body_digest`."""
    parts = body_parts(body)
    if parts is None:
        return _canonical(body)
    head, msgs, tail = parts
    return head + "[" + ",".join(msgs) + "]" + tail


def all_utf8(body: Mapping[str, Any]) -> bool:
    """Whether every string of a request body, keys included, is UTF-8 text (no lone surrogate), at C speed: its
    canonical JSON encodes strictly (each message's verdict cached with its JSON, so a growing history checks only
    its new messages).  False when it does not or cannot be had; a walk of the strings then decides (and says where)."""
    try:
        parts = body_parts(body)
        if parts is None:
            return utf8(_canonical(body))
        head, msgs, tail = parts
        return utf8(head) and utf8(tail) and all(map(_message_utf8, msgs))
    except (TypeError, ValueError, RecursionError):
        return False


def body_parts(body: Mapping[str, Any]) -> tuple[str, list[str], str] | None:
    """(the canonical JSON before the messages' ``[``, each message's, the text after their ``]``), None when the
    messages are not a list of objects (the body is then encoded as one)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        return None
    keys = sorted(body)  # as json.dumps(sort_keys=True) orders them
    at = keys.index("messages")
    head = "{" + "".join(_member(body, k) + "," for k in keys[:at]) + _canonical("messages") + ":"
    tail = "".join("," + _member(body, k) for k in keys[at + 1:]) + "}"
    return head, list(map(message_json, msgs)), tail


def message_json(m: dict) -> str:
    """One message's canonical JSON; cached by its fields when they are all text (equal text, equal JSON)."""
    if all(isinstance(v, str) for v in m.values()):
        return _cached_message_json(tuple(m.items()))
    return _canonical(m)  # null, numbers, content parts, tool calls: encoded as they are


def _history_sha(head: str, msgs: Sequence[str]):
    """A SHA-256 state after ``head + "[" + ",".join(msgs)``: the kept state of the longest kept prefix of the
    history (usually the previous call's) copied and fed the rest; the state of the whole history is kept."""
    keys = list(itertools.accumulate(msgs, lambda h, m: hash((h, m)), initial=hash(head)))  # keys[j]: msgs[:j]
    j, sha = len(msgs), None
    with _states_lock:
        while j > 0 and sha is None:
            kept = _states.get((keys[j], j))
            if kept is not None and kept[0] == head and kept[1] == tuple(msgs[:j]):
                _states.move_to_end((keys[j], j))
                sha = kept[2].copy()
            else:
                j -= 1
    if sha is None:
        sha = hashlib.sha256(_encode(head + "["))
    if j == len(msgs):
        return sha
    sha.update(_encode(("," if j else "") + ",".join(msgs[j:])))
    with _states_lock:
        _states[(keys[-1], len(msgs))] = (head, tuple(msgs), sha.copy())
        while len(_states) > STATES_KEPT:
            _states.popitem(last=False)
    return sha


def _member(body: Mapping[str, Any], key: Any) -> str:
    return _canonical(key) + ":" + _canonical(body[key])


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (or bytes the server decoded with surrogateescape)
        return False
    return True


_message_utf8 = lru_cache(maxsize=8192)(utf8)  # keyed by the cached message JSON: its hash is kept with it


@lru_cache(maxsize=8192)
def _cached_message_json(items: tuple) -> str:
    return _canonical(dict(items))
