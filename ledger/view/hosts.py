"""Which ``Host`` names ``ledger serve`` answers (DNS rebinding, SPEC 11.7): its listen address,
localhost, the loopback addresses and every ``--allow-host`` name; :class:`HostCheck` refuses the rest.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from starlette.responses import PlainTextResponse

from ledger.view.request import SECURITY_HEADERS

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str | None:
    """The host of a ``Host`` header (``"[::1]:8765"`` -> ``"::1"``, ``"LocalHost."`` ->
    ``"localhost"``); ``None`` when it is not ``host`` or ``host:port``."""
    h = value.strip().lower()
    if h.startswith("["):
        name, close, rest = h[1:].partition("]")
        if not close:
            return None
    else:
        name, sep, port = h.partition(":")
        rest = sep + port
    if rest and not (rest[:1] == ":" and rest[1:].isdigit() and len(rest) <= 6):
        return None
    name = name[:-1] if name.endswith(".") else name
    return name or None


def allowed_hosts(listen_host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names ``ledger serve`` answers: its listen address, localhost and the loopback
    addresses, and every ``--allow-host`` name (compared as :func:`host_name` reads a header)."""
    names = {listen_host, *LOCAL_HOSTS, *extra}
    return frozenset(n for n in map(normal_host, names) if n)


def normal_host(text: str) -> str | None:
    """A listen address or ``--allow-host`` value as :func:`host_name` reads it from a header
    (a bare IPv6 address such as ``::1`` included)."""
    return host_name(f"[{text}]" if text.count(":") > 1 and text[:1] != "[" else text)


class HostCheck:
    """ASGI middleware: a request whose ``Host`` is not one of ``allowed`` gets 421 (no ``Host``,
    or two, or a malformed one: 400) and none of the store's data.  A web page the user opens
    can point a name it controls at 127.0.0.1 (DNS rebinding); its requests then carry that
    name, never one of ours."""

    def __init__(self, app: Any, allowed: Iterable[str]) -> None:
        self.app, self.allowed = app, frozenset(allowed)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            refusal = self.refusal([v for k, v in scope.get("headers", ()) if k == b"host"])
            if refusal is not None:
                status, message = refusal
                await PlainTextResponse(message + "\n", status_code=status, headers=SECURITY_HEADERS)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, values: list[bytes]) -> tuple[int, str] | None:
        if len(values) != 1:
            return 400, f"a request needs exactly one Host header, it has {len(values)}"
        raw = values[0].decode("latin-1")
        name = host_name(raw)
        if name is None:
            return 400, f"malformed Host header {raw[:80]!r}"
        if name not in self.allowed:
            return 421, (f"misdirected request: {name[:80]!r} is not a name of this server (ledger serve answers "
                         "its listen address and localhost; `--allow-host NAME` adds a name)")
        return None
