"""Prefix matching for per-execution prefix trees (SPEC §6.1).  Pure algorithm, no I/O.

A :class:`Tree` holds every request of one execution.  Each :class:`Node` holds a token
segment (``uint32``), one flag byte per token and one behaviour log-prob per token; the
concatenation of the segments from the root to a request's node is that request's
``input_ids + output_ids`` exactly.

Inserting a request (:meth:`Tree.insert`):

1. **Match.**  The longest existing path that is a prefix of the request's *input* is
   found (any root-to-position prefix counts, so the match may end inside a node).  Sibling
   nodes may hold identical tokens (outputs are never shared), so matching is a depth-first
   search over the children whose first token fits; the deepest end point wins, and among
   equally deep end points the first one in preference order wins: at every sibling choice
   the sibling on the hinted request's path (``parent_request_id``) comes first, then the
   earliest recorded sibling.  A hint therefore only breaks ties; it never overrides a
   longer match.
2. **Split.**  A match that ends inside a node splits it radix style.  The node keeps its
   id, its tail tokens, its children and the requests mapped to it; a new node takes the
   head tokens and the node's place under its parent.  Every token keeps its flags and
   log-prob (segments are sliced, never re-derived).
3. **Attach.**  The rest of the input followed by the output becomes a new node under the
   match point (the root when nothing matched).  Outputs are never shared: two requests
   that sampled identical tokens from the same context get two sibling nodes.

The hot path works on packed memory: a node keeps its segment as packed little-endian
``uint32`` bytes (flags and log-probs likewise), children are found by first token through
a dict, a whole segment is compared with one ``bytes.startswith`` at the input offset (a
``memcmp`` that stops at the first difference, no copy), and only a segment that does not
match entirely is scanned once with numpy (``argmax`` of ``!=`` on zero-copy views) to
locate the mismatch.  New nodes and splits are bytes slicing/concatenation.  No Python
loop ever runs over tokens.

Node ids are internal creation ids (dense, ``0..n-1``).  Because a split gives the *head*
the new id, a parent can have a larger id than its child; :func:`creation_order` gives
the parent-before-child numbering views use (by the sequence number of the request that
recorded the tokens, then by depth).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ledger.algorithms.errors import InputError, IntegrityError

__all__ = [
    "FLAG_CANDIDATE",
    "FLAG_OUTPUT",
    "InsertResult",
    "as_packed",
    "as_tokens",
    "Node",
    "PrefixReferenceError",
    "Tree",
    "common_prefix",
    "creation_order",
    "output_flag",
    "prefix_reference",
]

U32 = np.dtype("<u4")
U8 = np.dtype("u1")
F32 = np.dtype("<f4")

FLAG_OUTPUT = 1
"""Bit 0: the token is an output token of the request that recorded it."""
FLAG_CANDIDATE = 2
"""Bit 1: policy target candidate (output of a ``generator == "policy"`` request that is not
``reconstructed``)."""

_EMPTY_U32 = np.zeros(0, dtype=U32)
_EMPTY_U32.setflags(write=False)
_NAN4 = np.array([np.nan], dtype=F32).tobytes()  # one float32 quiet NaN, little-endian
_first = struct.Struct("<I").unpack_from


def output_flag(generator: str, reconstructed: bool) -> int:
    """Flag byte of a request's output tokens."""
    return FLAG_OUTPUT | (FLAG_CANDIDATE if generator == "policy" and not reconstructed else 0)


def as_tokens(ids: bytes | bytearray | memoryview | np.ndarray | Sequence[int] | None) -> np.ndarray:
    """Token IDs as a 1-D little-endian ``uint32`` array (zero-copy for packed bytes)."""
    if ids is None:
        return _EMPTY_U32
    if isinstance(ids, (bytes, bytearray, memoryview)):
        return np.frombuffer(ids, dtype=U32) if len(ids) else _EMPTY_U32
    arr = np.asarray(ids)
    if arr.dtype != U32:
        arr = arr.astype(U32)
    return arr.reshape(-1)


def as_packed(ids: bytes | bytearray | memoryview | np.ndarray | Sequence[int] | None) -> bytes:
    """Token IDs as packed little-endian ``uint32`` bytes."""
    if ids is None:
        return b""
    if isinstance(ids, bytes):
        return ids
    if isinstance(ids, (bytearray, memoryview)):
        return bytes(ids)
    return np.ascontiguousarray(np.asarray(ids).reshape(-1), dtype=U32).tobytes()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    neq = a[:n] != b[:n]
    i = int(neq.argmax())
    return i if neq[i] else n


def tokens_sha256(tokens: np.ndarray | bytes) -> str:
    """SHA-256 (hex) of tokens packed as little-endian uint32 (the prefix-reference hash)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return hashlib.sha256(tokens).hexdigest()
    arr = np.ascontiguousarray(tokens, dtype=U32)
    return hashlib.sha256(memoryview(arr).cast("B")).hexdigest()


def prefix_reference(previous: np.ndarray, new_input: np.ndarray, *, min_length: int = 1) -> int:
    """Length of the prefix of ``new_input`` that ``previous`` (a request's input+output)
    covers, or 0 when it is shorter than ``min_length`` (a reference would not pay off)."""
    n = common_prefix(previous, new_input)
    return n if n >= max(1, min_length) else 0


class PrefixReferenceError(InputError):
    """A prefix reference does not resolve against the tree (unknown request, too long, hash)."""


class Node:
    """One segment of the tree: packed ``raw`` tokens, ``flag`` bytes and ``lp`` float32
    bytes (immutable ``bytes``; splits slice them)."""

    __slots__ = ("id", "parent", "raw", "flag", "lp", "origin", "order", "start", "children", "empties", "h")

    def __init__(self, id: int, parent: "Node | None", raw: bytes, flag: bytes, lp: bytes,
                 origin: str, order: int, start: int) -> None:
        self.id = id
        self.parent = parent  # None: a child of the (virtual) root
        self.raw = raw  # uint32 LE tokens
        self.flag = flag  # uint8 per token
        self.lp = lp  # float32 LE per token
        self.origin = origin  # request id that recorded these tokens
        self.order = order  # that request's sequence number in the execution (sibling order)
        self.start = start  # depth (in tokens) where the segment starts
        self.children: dict[int, list[Node]] = {}  # by first token, each list in `order` order
        self.empties: list[Node] = []  # zero-token children (never matched through)
        self.h = None  # lazily: sha256 state over the packed tokens root..end (prefix-reference checks)

    def __len__(self) -> int:
        return len(self.raw) >> 2

    @property
    def end(self) -> int:
        return self.start + (len(self.raw) >> 2)

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.raw, dtype=U32) if self.raw else _EMPTY_U32

    @property
    def flags(self) -> np.ndarray:
        return np.frombuffer(self.flag, dtype=U8)

    @property
    def logprobs(self) -> np.ndarray:
        return np.frombuffer(self.lp, dtype=F32)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        p = self.parent.id if self.parent is not None else None
        return f"Node(id={self.id}, parent={p}, len={len(self)}, origin={self.origin!r})"


@dataclass(frozen=True)
class InsertResult:
    """What :meth:`Tree.insert` changed: the request's new node, and the nodes whose stored
    row changed (the new node, and on a split the new head node and the split node)."""

    node: Node
    matched: int  # tokens of the input found on existing paths
    changed: tuple[Node, ...]


class Tree:
    """The prefix tree of one execution."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []  # by internal id
        self.root_children: dict[int, list[Node]] = {}
        self.root_empties: list[Node] = []
        self.requests: dict[str, Node] = {}  # request id -> its node
        self.request_order: dict[str, int] = {}  # request id -> sequence number
        self.stored_tokens = 0
        self.expanded_tokens = 0

    def release(self) -> None:
        """Drop every node's parent link, which breaks the parent <-> children reference cycles, so
        reference counting frees the tree as soon as its owner lets go of it (a tree is otherwise
        garbage only for the cyclic collector, whose full passes are rare: a replay that evicts
        trees from its cache then grows with the log, issue 19).  The tree is unusable afterwards;
        call it only on a tree nothing else holds."""
        for n in self.nodes:
            n.parent = None

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.nodes)

    def path_nodes(self, node: Node) -> list[Node]:
        """Nodes from the root to ``node`` (inclusive), root side first."""
        out = []
        cur: Node | None = node
        while cur is not None:
            out.append(cur)
            cur = cur.parent
        out.reverse()
        return out

    def path_bytes(self, request_id: str, length: int | None = None) -> bytes:
        """The first ``length`` tokens (default: all) of a request's path, packed."""
        node = self.requests[request_id]
        n = node.end if length is None else min(length, node.end)
        parts = []
        for nd in self.path_nodes(node):
            if nd.start >= n:
                break
            parts.append(nd.raw if nd.end <= n else nd.raw[: (n - nd.start) * 4])
        return b"".join(parts)

    def path(self, request_id: str, length: int | None = None) -> np.ndarray:
        """The first ``length`` tokens (default: all) of a request's root-to-node path."""
        return as_tokens(self.path_bytes(request_id, length))

    def resolve_prefix(self, request_id: str, length: int, sha256: str) -> bytes:
        """Verify a prefix reference and return the referenced tokens (packed)."""
        node = self.requests.get(request_id)
        if node is None:
            raise PrefixReferenceError(f"prefix reference to unknown request {request_id!r}")
        if length > node.end:
            raise PrefixReferenceError(
                f"prefix length {length} exceeds the {node.end} tokens of request {request_id!r}")
        # sha256 state at the end of the last whole node within `length`, plus the partial rest
        nodes = self.path_nodes(node)
        h, whole = None, 0
        for i in range(len(nodes) - 1, -1, -1):
            if nodes[i].end <= length:
                h, whole = _end_state(nodes[i]).copy(), i + 1
                break
        if h is None:
            h = hashlib.sha256()
        if whole < len(nodes) and nodes[whole].start < length:
            nd = nodes[whole]
            h.update(memoryview(nd.raw)[: (length - nd.start) * 4])
        if h.hexdigest() != sha256:
            raise PrefixReferenceError(
                f"sha256 of the first {length} tokens of request {request_id!r} does not match")
        return self.path_bytes(request_id, length)

    # ------------------------------------------------------------------ matching
    def _children(self, node: Node | None) -> dict[int, list[Node]]:
        return self.root_children if node is None else node.children

    def match(self, inp: bytes | np.ndarray, hint: str | None = None) -> tuple[int, Node | None, int]:
        """Longest existing path that is a prefix of ``inp`` (packed bytes or an array).

        Returns ``(matched, node, offset)``: ``matched`` tokens of ``inp`` are on the tree;
        the path ends ``offset`` tokens into ``node`` (``offset == len(node)``: at its end;
        ``node is None``: nothing matched, the root).  Ties between equally deep end points
        go to the first in preference order: the sibling on the path of request ``hint``,
        then the earliest recorded sibling.
        """
        prefer: frozenset[int] | None = None  # the hint's path, computed on the first sibling choice
        inp = as_packed(inp)
        n_in = len(inp) >> 2
        if n_in == 0:
            return 0, None, 0
        cands = self.root_children.get(_first(inp, 0)[0])
        if not cands:
            return 0, None, 0
        best_len, best_node, best_off = 0, None, 0
        arr: np.ndarray | None = None
        stack: list[tuple[Node, int]] = []
        if len(cands) == 1:
            stack.append((cands[0], 0))
        else:
            prefer = self.hint_path(hint)
            _push(stack, cands, 0, prefer)
        while stack:
            node, pos = stack.pop()
            raw = node.raw
            ln = len(raw) >> 2
            if inp.startswith(raw, pos << 2):  # memcmp, stops at the first difference
                c = ln
            else:  # locate the mismatch once, vectorised
                if arr is None:
                    arr = np.frombuffer(inp, dtype=U32)
                seg = np.frombuffer(raw, dtype=U32)
                n = min(ln, n_in - pos)
                neq = seg[:n] != arr[pos:pos + n]
                i = int(neq.argmax())
                c = i if neq[i] else n
            end = pos + c
            if end > best_len:
                best_len, best_node, best_off = end, node, c
            if c == ln and end < n_in:
                nxt = node.children.get(_first(inp, end << 2)[0])
                if nxt:
                    if len(nxt) == 1:
                        stack.append((nxt[0], end))
                    else:
                        if prefer is None:
                            prefer = self.hint_path(hint)
                        _push(stack, nxt, end, prefer)
        return best_len, best_node, best_off

    def hint_path(self, request_id: str | None) -> frozenset[int]:
        """Node ids on the root-to-node path of ``request_id`` (empty if unknown/None)."""
        if request_id is None:
            return frozenset()
        node = self.requests.get(request_id)
        if node is None:
            return frozenset()
        return frozenset(n.id for n in self.path_nodes(node))

    # ------------------------------------------------------------------ inserting
    def insert(self, request_id: str, order: int, input_ids: bytes | np.ndarray, output_ids: bytes | np.ndarray,
               output_logprobs: bytes | np.ndarray | None, out_flag: int, *, hint: str | None = None) -> InsertResult:
        """Add one request (the caller checked it is new).  See the module docstring.

        Token IDs as packed ``uint32`` LE bytes (or arrays), log-probs as packed ``float32``
        LE bytes (or an array; ``None``: NaN)."""
        if request_id in self.requests:
            raise InputError(f"request {request_id!r} is already in the tree")
        inp = as_packed(input_ids)
        out = as_packed(output_ids)
        n_out = len(out) >> 2
        if output_logprobs is None:
            lp_out = _NAN4 * n_out
        else:
            lp_out = (output_logprobs if isinstance(output_logprobs, bytes)
                      else np.ascontiguousarray(output_logprobs, dtype=F32).tobytes())
            if len(lp_out) != len(out):
                raise InputError(f"{len(lp_out) >> 2} log-probs for {n_out} output tokens")
        matched, node, off = self.match(inp, hint)
        changed: list[Node] = []
        parent: Node | None
        if node is None:
            parent = None
        elif off < (len(node.raw) >> 2):
            parent = self._split(node, off)
            changed.append(parent)
            changed.append(node)
        else:
            parent = node
        rest = inp[matched << 2:]  # a copy: never pin the event's buffer
        n_rest = len(rest) >> 2
        new = Node(len(self.nodes), parent, rest + out, bytes(n_rest) + bytes((out_flag,)) * n_out,
                   _NAN4 * n_rest + lp_out, request_id, order, matched)
        self.nodes.append(new)
        self._attach(new)
        self.requests[request_id] = new
        self.request_order[request_id] = order
        self.stored_tokens += n_rest + n_out
        self.expanded_tokens += (len(inp) >> 2) + n_out
        changed.append(new)
        return InsertResult(new, matched, tuple(changed))

    def _attach(self, node: Node) -> None:
        if not node.raw:
            (self.root_empties if node.parent is None else node.parent.empties).append(node)
            return
        kids = self._children(node.parent)
        key = _first(node.raw, 0)[0]
        lst = kids.get(key)
        if lst is None:
            kids[key] = [node]
        else:  # keep sibling lists in recording order (order, then id)
            lst.append(node)
            if (lst[-2].order, lst[-2].id) > (node.order, node.id):
                lst.sort(key=lambda n: (n.order, n.id))

    def _split(self, node: Node, k: int) -> Node:
        """Split ``node`` after ``k`` tokens (0 < k < len).  ``node`` keeps its id, the tail,
        its children and its requests; a new head node takes its place.  Returns the head."""
        assert 0 < k < len(node)
        b = k << 2
        head = Node(len(self.nodes), node.parent, node.raw[:b], node.flag[:k], node.lp[:b],
                    node.origin, node.order, node.start)
        self.nodes.append(head)
        siblings = self._children(node.parent)[_first(node.raw, 0)[0]]
        siblings[siblings.index(node)] = head
        node.raw, node.flag, node.lp = node.raw[b:], node.flag[k:], node.lp[b:]
        node.start += k
        node.parent = head
        head.children = {_first(node.raw, 0)[0]: [node]}
        return head

    # ------------------------------------------------------------------ rebuilding
    @classmethod
    def from_rows(cls, nodes: Iterable[tuple[int, int | None, str, bytes, bytes, bytes]],
                  requests: Iterable[tuple[str, int, int]], stored: int | None = None,
                  expanded: int | None = None) -> "Tree":
        """Rebuild a tree from stored rows.

        ``nodes``: ``(node_id, parent_id | None, origin_request_id, tokens, flags, logprobs)``
        with packed blobs; ``requests``: ``(request_id, node_id, seq)``.
        """
        tree = cls()
        reqs = list(requests)
        order = {rid: seq for rid, _, seq in reqs}
        rows = sorted(nodes, key=lambda r: r[0])
        parents: dict[int, int | None] = {}
        for node_id, parent, origin, tok, fl, lp in rows:
            if node_id != len(tree.nodes):
                raise IntegrityError(f"stored node ids are not dense (expected {len(tree.nodes)}, got {node_id})")
            tok, fl, lp = bytes(tok or b""), bytes(fl or b""), bytes(lp or b"")
            if not (len(tok) == 4 * len(fl) == len(lp)):
                raise IntegrityError(f"node {node_id}: tokens, flags and logprobs differ in length")
            tree.nodes.append(Node(node_id, None, tok, fl, lp, origin, order.get(origin, 0), 0))
            parents[node_id] = parent
        for node in tree.nodes:
            pid = parents[node.id]
            node.parent = None if pid is None else tree.nodes[pid]
        for node in _topological(tree.nodes):  # starts: parents before children
            node.start = 0 if node.parent is None else node.parent.end
        for node in sorted(tree.nodes, key=lambda n: (n.order, n.start, n.id)):  # sibling lists in recording order
            tree._attach(node)
        for rid, node_id, seq in reqs:
            tree.requests[rid] = tree.nodes[node_id]
            tree.request_order[rid] = seq
        tree.stored_tokens = sum(len(n) for n in tree.nodes) if stored is None else stored
        tree.expanded_tokens = (sum(n.end for n in tree.requests.values()) if expanded is None else expanded)
        return tree


def _end_state(node: Node):
    """The sha256 state over root..``node``'s end (computed once per node, then cached)."""
    chain = []
    cur: Node | None = node
    while cur is not None and cur.h is None:
        chain.append(cur)
        cur = cur.parent
    h = cur.h if cur is not None else None
    for nd in reversed(chain):
        h = h.copy() if h is not None else hashlib.sha256()
        h.update(nd.raw)
        nd.h = h
    return node.h


def _push(stack: list, cands: list[Node], pos: int, prefer: frozenset[int] | set[int]) -> None:
    """Push sibling candidates so that the preferred one is popped first."""
    ordered = cands
    if prefer:
        hinted = [c for c in cands if c.id in prefer]
        if hinted:
            ordered = hinted + [c for c in cands if c.id not in prefer]
    for c in reversed(ordered):
        stack.append((c, pos))


def _topological(nodes: Sequence[Node]) -> list[Node]:
    """Nodes ordered parents first."""
    kids: dict[int, list[Node]] = {}
    roots = []
    for n in nodes:
        if n.parent is None:
            roots.append(n)
        else:
            kids.setdefault(n.parent.id, []).append(n)
    out: list[Node] = []
    stack = list(roots)
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(kids.get(n.id, ()))
    if len(out) != len(nodes):
        raise IntegrityError("stored tree has a cycle or a dangling parent")
    return out


def creation_order(nodes: Sequence[Node]) -> list[Node]:
    """Nodes in recording order, parents before children: by the sequence number of the
    request that recorded the tokens, then by depth.  (Origin sequence numbers never
    decrease from parent to child, and a head split from a node starts before it.)"""
    return sorted(nodes, key=lambda n: (n.order, n.start, n.id))
