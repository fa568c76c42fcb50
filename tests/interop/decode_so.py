"""Decode Avro single-object bytes with Apache Avro's Python package (``avro`` on PyPI).

An independent reader for the interop tests: nothing here imports ``ledger`` or fastavro.
The schema fingerprints are Apache Avro's own ``Schema.fingerprint("CRC-64-AVRO")``
(8 bytes, little-endian, as the Avro spec and BinaryMessageEncoder write them; computed on
a copy of the schema without ``logicalType``, see the note in ``__init__``) and the body
is read by ``avro.io.DatumReader`` with Avro schema resolution (writer schema = the one the
fingerprint names, reader schema = the newest ``<Name>.v<N>.avsc`` of the same record).

The ``avro`` package has no single-object/message decoder of its own (unlike Java's
``BinaryMessageDecoder``), so the 10-byte header (``C3 01`` + fingerprint) is split off
here; everything after that is Apache Avro's code.

CLI::

    python tests/interop/decode_so.py [--schemas DIR] [--reader latest|writer] [FILE ...]

reads each FILE (or all of stdin when none or ``-``) as ONE single-object message and
prints one JSON object per message: ``schema`` (file name), ``fingerprint`` (hex of the 8
bytes as found), ``datum``.  In ``datum`` bytes are lowercase hex and timestamp-micros
fields are integer microseconds since the epoch (what our JSON fixtures hold).  Exit 1 on
a message it cannot decode (unknown fingerprint, bad marker, trailing bytes, ...).

Library::

    from tests.interop.decode_so import AvroSingleObjectReader
    reader = AvroSingleObjectReader(schema_dir)
    schema_file, datum = reader.decode(data)   # datum with bytes as bytes, timestamps as int
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import avro.io
import avro.schema

MAGIC = b"\xc3\x01"
_FILE_RE = re.compile(r"^(?P<name>[A-Za-z]+)\.v(?P<version>\d+)\.avsc$")
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_ONE_MICRO = datetime.timedelta(microseconds=1)
DEFAULT_SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"


class DecodeError(ValueError):
    pass


class AvroSingleObjectReader:
    def __init__(self, schema_dir: Path = DEFAULT_SCHEMA_DIR, reader: str = "latest") -> None:
        if reader not in ("latest", "writer"):
            raise ValueError("reader must be 'latest' or 'writer'")
        self.reader = reader
        self.by_fingerprint: dict[bytes, tuple[str, avro.schema.Schema, str]] = {}
        newest: dict[str, tuple[int, avro.schema.Schema]] = {}
        for path in sorted(Path(schema_dir).glob("*.avsc")):
            m = _FILE_RE.match(path.name)
            if not m:
                raise DecodeError(f"schema file name {path.name!r} is not <Name>.v<N>.avsc")
            raw = json.loads(path.read_text())
            schema = avro.schema.parse(json.dumps(raw))
            # Apache Avro's CRC-64-AVRO (8 bytes, little-endian), over a copy WITHOUT
            # logicalType: avro 1.12.2's canonical_form renders {"type": "long",
            # "logicalType": "timestamp-micros"} as {"type":"long"} instead of "long" (the
            # spec's [PRIMITIVES] rule; Java, fastavro and avsc give "long"), so its
            # fingerprint of any schema with a logical type differs from every other
            # implementation's.  Stripping logicalType first gives the spec's form.
            fp = avro.schema.parse(json.dumps(_strip_logical(raw))).fingerprint("CRC-64-AVRO")
            self.by_fingerprint[fp] = (path.name, schema, schema.fullname)
            version = int(m["version"])
            if schema.fullname not in newest or version > newest[schema.fullname][0]:
                newest[schema.fullname] = (version, schema)
        self.newest = {name: s for name, (_, s) in newest.items()}
        # The SPEC 4.1 test vector: the primitive schema "null".
        null = avro.schema.parse('"null"')
        self.by_fingerprint.setdefault(null.fingerprint("CRC-64-AVRO"), ('"null"', null, "null"))
        self.newest.setdefault("null", null)

    def decode(self, data: bytes) -> tuple[str, Any]:
        """(writer schema file name, datum) of one single-object message."""
        data = bytes(data)
        if len(data) < 10 or data[:2] != MAGIC:
            raise DecodeError("not an Avro single-object encoding (missing C3 01 marker)")
        fp = data[2:10]
        entry = self.by_fingerprint.get(fp)
        if entry is None:
            hint = ""
            if fp[::-1] in self.by_fingerprint:
                hint = (f"; the REVERSED bytes {fp[::-1].hex()} are the fingerprint of "
                        f"{self.by_fingerprint[fp[::-1]][0]} (big-endian, not the Avro spec's order)")
            raise DecodeError(f"unknown schema fingerprint {fp.hex()}{hint}")
        name, writer, fullname = entry
        reader = writer if self.reader == "writer" else self.newest[fullname]
        body = io.BytesIO(data[10:])
        datum = avro.io.DatumReader(writer, reader).read(avro.io.BinaryDecoder(body))
        if body.tell() != len(data) - 10:
            raise DecodeError(f"{len(data) - 10 - body.tell()} trailing bytes after the {name} body")
        return name, _plain(datum)


def _strip_logical(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_logical(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_strip_logical(v) for v in schema]
    return schema


def _plain(v: Any) -> Any:
    """timestamp-micros datetimes back to int micros (exact); everything else unchanged."""
    if isinstance(v, datetime.datetime):
        return (v - _EPOCH) // _ONE_MICRO
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def to_json(v: Any) -> Any:
    """bytes as lowercase hex, for printing and for comparing with the fixture JSON files."""
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {k: to_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [to_json(x) for x in v]
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=Path, default=DEFAULT_SCHEMA_DIR, help="directory of <Name>.v<N>.avsc files")
    ap.add_argument("--reader", choices=("latest", "writer"), default="latest",
                    help="reader schema: newest version of the record (default) or the writer's own")
    ap.add_argument("files", nargs="*", help="single-object files; none or '-' = stdin")
    args = ap.parse_args(argv)
    reader = AvroSingleObjectReader(args.schemas, args.reader)
    status = 0
    for f in args.files or ["-"]:
        data = sys.stdin.buffer.read() if f == "-" else Path(f).read_bytes()
        try:
            name, datum = reader.decode(data)
        except Exception as exc:  # avro raises several exception types on corrupt input
            print(f"{f}: {type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
            continue
        print(json.dumps({"file": f, "schema": name, "fingerprint": data[2:10].hex(), "datum": to_json(datum)},
                         ensure_ascii=False))
    return status


if __name__ == "__main__":
    sys.exit(main())
