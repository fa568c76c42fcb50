"""The canary scan of a training manifest (SPEC §11.2; seed 002 §15.9.3).

``manifest publish`` of a training route (sft, preference, rl) passes the route's trainer
records through :meth:`RecordScanner.watch` on their way to the manifest builder, so the scan
reads exactly the records whose digests the manifest signs, in the same single pass.  The
records' tokens are gathered into packed uint32 batches of about a million tokens and each
batch is scanned once for every declared canary
(:func:`ledger.algorithms.canaries.segment_matches`: one pass, not one per canary).

What is scanned: a path record's ``input_ids`` (prompt context and targets alike: the trainer
reads all of it); a preference pair's ``prompt_ids + chosen_ids`` and ``prompt_ids +
rejected_ids`` (the two sequences a DPO trainer reads; the prompt is scanned once, plus the
last ``max canary length - 1`` tokens again before the rejected side, so a copy that spans the
prompt and a continuation is found).  A copy spanning two records is no copy.

An occurrence is an :class:`Escape` (member, canary, field and index of its first token).
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from ledger.algorithms.canaries import CanaryMatcher, segment_matches
from ledger.algorithms.errors import IntegrityError
from ledger.algorithms.tokens import U32, unpack_tokens

__all__ = ["BATCH_TOKENS", "CanaryEscaped", "Escape", "RecordScanner", "MAX_KEPT"]

BATCH_TOKENS = 1 << 20  # tokens gathered before a batch is scanned
MAX_KEPT = 1000  # escapes kept for the report (all are counted)
_LISTED = 10


@dataclass(frozen=True)
class Escape:
    member_id: str
    canary_id: str
    field: str  # input_ids | prompt_ids | chosen_ids | rejected_ids
    position: int  # index in that field of the canary's first token

    def to_json(self) -> dict:
        return {"member_id": self.member_id, "canary_id": self.canary_id, "field": self.field,
                "position": self.position}

    def __str__(self) -> str:
        return f"canary {self.canary_id!r} escaped into member {self.member_id} at {self.field}[{self.position}]"


class CanaryEscaped(IntegrityError):
    """A training manifest would contain a declared canary: it is not signed (exit 1).
    ``escapes``: the occurrences (at most :data:`MAX_KEPT`); ``count``: all of them;
    ``doc``: the unsigned document that was built (for ``verify --deep``'s comparison)."""

    def __init__(self, route: str, escapes: list[Escape], count: int, doc: dict | None = None) -> None:
        self.route, self.escapes, self.count, self.doc = route, escapes, count, doc
        shown = "; ".join(str(e) for e in escapes[:_LISTED])
        more = f"; ... and {count - _LISTED} more" if count > _LISTED else ""
        super().__init__(f"route {route}: {count} canary occurrence(s) in the training corpus, so the manifest is "
                         f"not signed: {shown}{more}")


@dataclass
class _Segment:
    member_id: str
    fields: tuple[tuple[str, int, int], ...]  # (field, offset in the segment, index of that offset in the field)
    min_end: int  # an occurrence must end past this offset (the repeated prompt tail is scanned already)

    def where(self, offset: int) -> tuple[str, int]:
        name, start, first = next(f for f in reversed(self.fields) if f[1] <= offset)
        return name, first + offset - start


class RecordScanner:
    """Scans the records that pass through :meth:`watch` for ``canaries`` (rows of
    :func:`projections.canaries.declared`); ``pairs``: the records are preference pairs."""

    def __init__(self, canaries: list[Mapping], *, pairs: bool = False, batch_tokens: int = BATCH_TOKENS) -> None:
        self.ids = [c["canary_id"] for c in canaries]
        self.scope = [list(c["scope"]) for c in canaries]
        self.matcher = CanaryMatcher([unpack_tokens(c["token_ids"]) for c in canaries])
        self.pairs, self.batch_tokens = pairs, batch_tokens
        self.tail = max(0, self.matcher.max_len - 1)
        self.escapes: list[Escape] = []
        self.escaped: set[str] = set()  # canary ids found
        self.count = self.members = self.tokens = 0
        self._arrays: list[np.ndarray] = []
        self._segments: list[_Segment] = []
        self._size = 0

    # ------------------------------------------------------------------ feeding
    def watch(self, records: Iterable[dict]) -> Iterator[dict]:
        """Yield ``records`` unchanged, scanning each one's tokens (the last batch at the end)."""
        for rec in records:
            self.add(rec)
            yield rec
        self.flush()

    def add(self, rec: Mapping) -> None:
        self.members += 1
        if self.pairs:
            self._add_pair(rec)
        else:
            ids = _array(rec.get("input_ids"))
            self.tokens += ids.size
            self._push(ids, _Segment(rec["member_id"], (("input_ids", 0, 0),), 0))
        if self._size >= self.batch_tokens:
            self.flush()

    def _add_pair(self, rec: Mapping) -> None:
        mid = rec["member_id"]
        prompt, chosen, rejected = (_array(rec.get(k)) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
        self.tokens += prompt.size + chosen.size + rejected.size
        tail = prompt[max(0, prompt.size - self.tail):]
        self._push(np.concatenate([prompt, chosen]),
                   _Segment(mid, (("prompt_ids", 0, 0), ("chosen_ids", prompt.size, 0)), 0))
        self._push(np.concatenate([tail, rejected]),
                   _Segment(mid, (("prompt_ids", 0, prompt.size - tail.size), ("rejected_ids", tail.size, 0)),
                            tail.size))

    def _push(self, tokens: np.ndarray, segment: _Segment) -> None:
        self._arrays.append(tokens)
        self._segments.append(segment)
        self._size += tokens.size

    # ------------------------------------------------------------------ scanning
    def flush(self) -> None:
        """Scan the gathered batch in one pass and record its occurrences."""
        if not self._arrays:
            return
        sizes = np.fromiter((a.size for a in self._arrays), dtype=np.int64, count=len(self._arrays))
        bounds = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        seg, offset, canary = segment_matches(self.matcher, np.concatenate(self._arrays), bounds)
        if seg.size:
            ends = offset + self.matcher.lengths[canary]
            for s, o, c, e in zip(seg.tolist(), offset.tolist(), canary.tolist(), ends.tolist()):
                segment = self._segments[s]
                if e <= segment.min_end:
                    continue  # wholly inside the repeated prompt tail: found with the chosen side
                self.count += 1
                self.escaped.add(self.ids[c])
                if len(self.escapes) < MAX_KEPT:
                    self.escapes.append(Escape(segment.member_id, self.ids[c], *segment.where(o)))
        self._arrays, self._segments, self._size = [], [], 0

    def summary(self) -> dict:
        """The datasheet's ``canaries`` section (see :func:`datasheet_section`)."""
        return datasheet_section(self.scope, scanned=len(self.ids), members=self.members, tokens=self.tokens,
                                 escaped=len(self.escaped))


def datasheet_section(scopes: list[list[str]], *, scanned: int, members: int, tokens: int, escaped: int) -> dict:
    """Canaries planted (declared at the manifest's log position, and per split of their scope),
    scanned for, and escaped into the corpus, with the members and tokens the scan read."""
    by_scope: dict[str, int] = {}
    for scope in scopes:
        for split in scope:
            by_scope[split] = by_scope.get(split, 0) + 1
    return {"planted": len(scopes), "planted_by_scope": dict(sorted(by_scope.items())), "scanned": scanned,
            "escaped": escaped, "members_scanned": members, "tokens_scanned": tokens,
            "scan": "every member's tokens (a pair's prompt+chosen and prompt+rejected) against every canary declared "
                    "at the log position, in one pass; an exact token-sequence match is an escape and refuses the "
                    "signature"}


_NATIVE_U32 = array.array("I").itemsize == 4


def _array(values) -> np.ndarray:
    """A record's token list as a uint32 array (``array.array`` converts a Python list ~3x faster
    than numpy does)."""
    if values is None or len(values) == 0:
        return np.zeros(0, dtype=U32)
    if _NATIVE_U32 and isinstance(values, list):
        return np.frombuffer(memoryview(array.array("I", values)).cast("B"), dtype=np.uint32)  # plain bytes: no
        # PEP 3118 format parsing in numpy
    return np.asarray(values, dtype=U32)
