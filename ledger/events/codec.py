"""Avro single-object encoding of events (SPEC §4.1).

An event on the log is ``C3 01`` + the 8-byte little-endian CRC-64-AVRO fingerprint of the
writer schema's Parsing Canonical Form + the Avro binary body.  The codec knows every
schema file in ``schemas/`` (old versions stay there forever) and decodes any fingerprint
it finds there, resolving to the newest version of the same record (Avro resolution).

Byte order: the Avro specification's (for ``"null"``: ``8a 8f 25 cc e7 24 dd 63``), which
is what Apache Avro (Java, Python) and fastavro write.  Events written before that rule
was enforced carry the 8 bytes reversed; :meth:`Codec.writer_schema` accepts both orders
forever, the encoder writes only the standard order (``legacy_fingerprint_order=True``
exists so tests can build such an old log).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint as avro_fingerprint
from fastavro.schema import to_parsing_canonical_form

from ledger.algorithms.errors import InputError

MAGIC = b"\xc3\x01"
SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"  # in the checkout a link to the top-level schemas/; in the wheel the files
_FILE_RE = re.compile(r"^(?P<name>[A-Za-z]+)\.v(?P<version>\d+)\.avsc$")


class CodecError(InputError):
    """An event could not be encoded or decoded."""


@dataclass(frozen=True)
class SchemaVersion:
    name: str  # record name without namespace, e.g. "RequestRecorded"
    version: int
    event_type: str  # JSON-lines type, e.g. "request"
    parsed: Any  # fastavro parsed schema
    plain: Any  # the same schema without logical types (timestamps decode as int micros)
    fingerprint: bytes  # 8 bytes, little-endian CRC-64-AVRO (the Avro spec's wire order)
    path: Path

    @property
    def legacy_fingerprint(self) -> bytes:
        """The same 8 bytes reversed, as events written before SPEC 4.1's byte-order rule carry them."""
        return self.fingerprint[::-1]


def _crc64_fingerprint(schema: Any) -> bytes:
    """The 8 wire bytes of the CRC-64-AVRO fingerprint of ``schema``'s Parsing Canonical Form.

    fastavro returns the hex of the little-endian bytes already (``"null"`` ->
    ``"8a8f25cce724dd63"``), so the bytes are ``bytes.fromhex``; reading that hex as an
    integer and writing it little-endian reversed them (the legacy order)."""
    return bytes.fromhex(avro_fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))


def _strip_logical(schema: Any) -> Any:
    """Copy of a schema with every ``logicalType`` removed."""
    if isinstance(schema, dict):
        return {k: _strip_logical(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_strip_logical(v) for v in schema]
    return schema


class Codec:
    """Encoder/decoder over the schema files of one directory."""

    def __init__(self, schema_dir: Path = SCHEMA_DIR, *, legacy_fingerprint_order: bool = False) -> None:
        """``legacy_fingerprint_order=True`` makes :meth:`encode` write the 8 fingerprint bytes
        reversed, as the ledger did before SPEC 4.1's byte-order rule: for tests that build
        an old log.  Decoding accepts both orders whatever this flag says."""
        self.legacy_fingerprint_order = legacy_fingerprint_order
        self.by_fingerprint: dict[bytes, SchemaVersion] = {}  # standard order only
        self.by_legacy_fingerprint: dict[bytes, SchemaVersion] = {}  # the reversed bytes
        self.latest: dict[str, SchemaVersion] = {}  # by event_type
        for path in sorted(schema_dir.glob("*.avsc")):
            match = _FILE_RE.match(path.name)
            if not match:
                raise CodecError(f"schema file name {path.name!r} is not <Name>.v<N>.avsc")
            raw = json.loads(path.read_text())
            event_type = next(f["default"] for f in raw["fields"] if f["name"] == "event_type")
            sv = SchemaVersion(
                name=match["name"],
                version=int(match["version"]),
                event_type=event_type,
                parsed=fastavro.parse_schema(raw, named_schemas={}),
                plain=fastavro.parse_schema(_strip_logical(raw), named_schemas={}),
                fingerprint=_crc64_fingerprint(raw),
                path=path,
            )
            if sv.fingerprint in self.by_fingerprint:
                raise CodecError(f"{path.name} duplicates the fingerprint of {self.by_fingerprint[sv.fingerprint].path.name}")
            self.by_fingerprint[sv.fingerprint] = sv
            self.by_legacy_fingerprint[sv.legacy_fingerprint] = sv
            current = self.latest.get(event_type)
            if current is None or sv.version > current.version:
                self.latest[event_type] = sv
        for fp, sv in self.by_legacy_fingerprint.items():
            other = self.by_fingerprint.get(fp)
            if other is not None and other is not sv:  # 2**-64 per pair, but never ambiguous
                raise CodecError(f"the reversed fingerprint of {sv.path.name} is the fingerprint of {other.path.name}")

    def schema_for(self, event_type: str) -> SchemaVersion:
        try:
            return self.latest[event_type]
        except KeyError:
            raise CodecError(f"unknown event type {event_type!r}") from None

    def encode(self, event: dict, schema: SchemaVersion | None = None) -> bytes:
        """Single-object encode ``event`` with the newest schema of its type (or ``schema``)."""
        sv = schema or self.schema_for(event["event_type"])
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(sv.legacy_fingerprint if self.legacy_fingerprint_order else sv.fingerprint)
        try:
            fastavro.schemaless_writer(buf, sv.parsed, event)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CodecError(f"{event.get('event_type')}: cannot encode: {exc}") from exc
        return buf.getvalue()

    def writer_schema(self, data: bytes) -> SchemaVersion:
        if len(data) < 10 or data[:2] != MAGIC:
            raise CodecError("not an Avro single-object encoding (missing C3 01 marker)")
        fp = bytes(data[2:10])
        sv = self.by_fingerprint.get(fp) or self.by_legacy_fingerprint.get(fp)
        if sv is None:
            raise CodecError(f"unknown schema fingerprint {fp.hex()}")
        return sv

    def is_legacy_order(self, data: bytes) -> bool:
        """True when ``data`` carries its fingerprint in the pre-SPEC-4.1 reversed order."""
        fp = bytes(data[2:10])
        return fp not in self.by_fingerprint and fp in self.by_legacy_fingerprint

    def decode(self, data: bytes) -> dict:
        """Decode single-object bytes, resolving the writer schema to the newest reader."""
        writer = self.writer_schema(data)
        reader = self.latest[writer.event_type]
        try:
            return fastavro.schemaless_reader(
                io.BytesIO(data[10:]),
                writer.plain,
                None if reader is writer else reader.plain,  # same schema: no resolution (nor fastavro's deep compare)
                return_record_name=False,
            )
        except Exception as exc:  # fastavro raises a variety of errors on corrupt bodies
            raise CodecError(f"cannot decode {writer.path.name} body: {exc}") from exc


@lru_cache(maxsize=1)
def default_codec() -> Codec:
    return Codec()


def event_digest(data: bytes) -> bytes:
    """SHA-256 over the single-object encoded bytes: what the log's Merkle tree commits to."""
    return hashlib.sha256(data).digest()


def _varint_len(n: int) -> int:
    if -64 <= n < 64:  # one byte after zigzag (the common case: short strings, small counts)
        return 1
    z = (n << 1) ^ (n >> 63)  # zigzag, as Avro encodes int/long
    length = 1
    while z >= 0x80:
        z >>= 7
        length += 1
    return length


def _string_len(s: str) -> int:
    b = len(s) if s.isascii() else len(s.encode("utf-8"))
    return (1 if b < 64 else _varint_len(b)) + b


def header_length(ev: dict) -> int:
    """Bytes of the Avro-encoded common header (event_id, event_type, occurred_at, producer, stamped)."""
    n = _string_len(ev["event_id"]) + _string_len(ev["event_type"]) + _varint_len(ev["occurred_at"])
    n += _string_len(ev["producer"])
    stamped = ev["stamped"]
    if stamped:
        n += _varint_len(len(stamped)) + sum(_string_len(s) for s in stamped)
    return n + 1  # array terminator (or the empty array's single zero)


def content_hash(ev: dict, encoded: bytes) -> bytes:
    """Hash of what the producer supplied: the encoded body minus the stamped header fields."""
    h = hashlib.sha256(ev["event_type"].encode())
    if "occurred_at" not in ev["stamped"]:
        h.update(ev["occurred_at"].to_bytes(8, "little", signed=True))
    h.update(memoryview(encoded)[10 + header_length(ev):])
    return h.digest()


# ---------------------------------------------------------------------- sealed requests
_REQUEST_LAYOUT = ("event_id", "event_type", "occurred_at", "producer", "stamped", "execution_id", "request_id",
                   "input_ids", "input_prefix", "input_suffix_ids", "output_ids", "output_logprobs", "agent_id",
                   "agent_tier", "turn_kind", "generator", "parent_request_id", "consumed_tool_call_ids",
                   "emitted_tool_call_ids", "reconstructed", "model", "finish_reason", "sealed")
_REQUEST_TAIL_STRINGS = ("agent_id", "agent_tier", "turn_kind", "generator")
_REQUEST_TAIL_OPTIONAL = ("parent_request_id", "model", "finish_reason")
_REQUEST_TAIL_ARRAYS = ("consumed_tool_call_ids", "emitted_tool_call_ids")
_REQUEST_SAME = ("event_id", "event_type", "occurred_at", "producer", "stamped", "execution_id", "request_id",
                 "input_prefix") + _REQUEST_TAIL_STRINGS + _REQUEST_TAIL_OPTIONAL + _REQUEST_TAIL_ARRAYS + ("reconstructed",)
# RequestRecorded.v3 adds the optional `metadata` just before `sealed`: one more optional string in the tail
_REQUEST_LAYOUTS = {_REQUEST_LAYOUT: (), _REQUEST_LAYOUT[:-1] + ("metadata", "sealed"): ("metadata",)}
_layout_ok: dict[bytes, tuple[str, ...] | None] = {}


def _length_prefix(n: int) -> bytes:
    """Avro's zigzag varint of a non-negative length."""
    z = n << 1
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _opt_bytes_len(v: Any) -> int:
    return 1 if v is None else 1 + _varint_len(len(v)) + len(v)


def _opt_string_len(v: Any) -> int:
    return 1 if v is None else 1 + _string_len(v)


def _array_len(items: Any) -> int:
    return 1 if not items else _varint_len(len(items)) + sum(_string_len(s) for s in items) + 1


def plain_content_hash(plain: dict, stored: dict, encoded: bytes, schema: SchemaVersion, codec: Codec) -> bytes:
    """``content_hash(plain, encode(plain))`` of a sealed event's plain copy ``plain``, where
    ``stored`` (its sealed copy) is ``encoded`` under ``schema``: spliced from ``encoded`` when the
    request layout allows (:func:`plain_request_content_hash`), else by encoding ``plain``.  What
    ingest stores as a sealed request's idempotency hash, and what audit recomputes."""
    h = plain_request_content_hash(plain, stored, encoded, schema) if schema.event_type == "request" else None
    return h if h is not None else content_hash(plain, codec.encode(plain, schema))


def plain_request_content_hash(plain: dict, stored: dict, encoded: bytes, schema: SchemaVersion) -> bytes | None:
    """``content_hash(plain, encode(plain))`` of a sealed request, computed from the encoding of
    its sealed copy ``stored`` (``encoded``) without encoding ``plain``: the two differ only in
    the token fields (written here from ``plain``) and ``sealed`` (null in ``plain``).

    Returns ``None`` (the caller encodes ``plain``) unless ``schema`` has the known request
    layout, the two records agree on every other field, the token values are ``bytes`` and the
    segment lengths computed from ``stored`` add up to exactly ``len(encoded)``."""
    if schema.fingerprint not in _layout_ok:
        _layout_ok[schema.fingerprint] = _REQUEST_LAYOUTS.get(tuple(f["name"] for f in schema.parsed["fields"]))
    extra = _layout_ok[schema.fingerprint]
    if extra is None:
        return None
    try:
        for k in _REQUEST_SAME + extra:
            if plain[k] != stored[k]:
                return None
        for k in ("input_ids", "input_suffix_ids", "output_logprobs"):
            if plain[k] is not None and type(plain[k]) is not bytes:
                return None
        if type(plain["output_ids"]) is not bytes or plain.get("sealed") is not None:
            return None
        sealed = stored["sealed"]
        hl = header_length(stored)
        ids_end = 10 + hl + _string_len(stored["execution_id"]) + _string_len(stored["request_id"])
        prefix_start = ids_end + _opt_bytes_len(stored["input_ids"])
        ref = stored["input_prefix"]
        prefix_end = prefix_start + (1 if ref is None else
                                     1 + _string_len(ref["request_id"]) + _varint_len(ref["length"]) + _string_len(ref["sha256"]))
        tail_start = (prefix_end + _opt_bytes_len(stored["input_suffix_ids"]) + _varint_len(len(stored["output_ids"]))
                      + len(stored["output_ids"]) + _opt_bytes_len(stored["output_logprobs"]))
        tail_len = (sum(_string_len(stored[k]) for k in _REQUEST_TAIL_STRINGS)
                    + sum(_opt_string_len(stored[k]) for k in _REQUEST_TAIL_OPTIONAL + extra)
                    + sum(_array_len(stored[k]) for k in _REQUEST_TAIL_ARRAYS) + 1)
        sealed_len = 1 if sealed is None else (1 + _string_len(sealed["key_id"]) + _opt_bytes_len(sealed["nonce"]) - 1
                                               + _opt_bytes_len(sealed["ciphertext"]) - 1)
    except (KeyError, TypeError, AttributeError):
        return None
    tail_end = tail_start + tail_len
    if tail_end + sealed_len != len(encoded):
        return None
    view = memoryview(encoded)
    h = hashlib.sha256(plain["event_type"].encode())
    if "occurred_at" not in plain["stamped"]:
        h.update(plain["occurred_at"].to_bytes(8, "little", signed=True))
    h.update(view[10 + hl:ids_end])
    for k in ("input_ids",):
        v = plain[k]
        h.update(b"\x00" if v is None else b"\x02" + _length_prefix(len(v)))
        if v is not None:
            h.update(v)
    h.update(view[prefix_start:prefix_end])
    for k in ("input_suffix_ids", "output_ids", "output_logprobs"):
        v = plain[k]
        if k == "output_ids":
            h.update(_length_prefix(len(v)))
        elif v is None:
            h.update(b"\x00")
            continue
        else:
            h.update(b"\x02" + _length_prefix(len(v)))
        h.update(v)
    h.update(view[tail_start:tail_end])
    h.update(b"\x00")  # sealed: null in the plain record
    return h.digest()
