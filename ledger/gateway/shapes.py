"""What the protocol modules share to map a request onto the gateway's chat-completion body (SPEC §11.4):
the error of a request a protocol cannot map, and helpers for text blocks, pass-through fields, integers and
function tools."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ledger.algorithms.errors import InputError

__all__ = ["ApiShapeError", "function_tools", "passthrough", "positive_int", "text_blocks"]


class ApiShapeError(InputError):
    """A request the adapter cannot map (HTTP 400 naming ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def text_blocks(value: Any, what: str, kinds: Sequence[str] = ("text",)) -> str:
    """A string, or the text of a list of text blocks (``kinds``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiShapeError(f"{what} must be a string or a list of text blocks", what)
    out = []
    for i, b in enumerate(value):
        if not isinstance(b, dict) or b.get("type") not in kinds or not isinstance(b.get("text"), str):
            raise ApiShapeError(f"{what}[{i}] must be a block of type {' or '.join(kinds)} with a string text", what)
        out.append(b["text"])
    return "\n".join(out)


def passthrough(body: Mapping[str, Any], known: frozenset[str]) -> dict:
    """Fields the adapter does not interpret: passed on (the gateway refuses reserved ones)."""
    return {k: v for k, v in body.items() if k not in known}


def positive_int(body: Mapping[str, Any], name: str, required: bool = False) -> int | None:
    v = body.get(name)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ApiShapeError(f"{name} must be a positive integer", name)
    return v


def function_tools(tools: Any, accepts: Any, what: str, schema: str) -> list[dict] | None:
    """Another API's client tools as Chat Completions function tools (None when absent): each a dict with a
    string ``name`` that ``accepts``, else refused naming ``what`` it must be; ``schema``: its parameters' key."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiShapeError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not accepts(t):
            raise ApiShapeError(f"tools[{i}] must be {what}", "tools")
        fn = {"name": t["name"], "parameters": t.get(schema) or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out
