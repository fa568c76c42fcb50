"""One logical schema per export format (SPEC 11.5): the Arrow types the Parquet writers use, which
are the types a JSON reader (``datasets``, polars, duckdb, pyarrow) infers from the JSON-lines
export of the same records — integers ``int64``, numbers ``float64``, strings, booleans, nested
objects as structs — so ``datasets.load_dataset("parquet", ...)`` and ``load_dataset("json", ...)``
give identical ``Features`` (``ledger.train.features(kind)`` states them; docs/train.md lists them).

The one exception is a tree-packed record's ``targets`` (SPEC §7.5): a JSON list of
``[target_index, predecessor_index|null, weight]`` triples mixes integers and floats, which no
Arrow list type holds, so a JSON reader widens it to floats.  Parquet keeps the integers (and the
null parents) as a list of ``{target_index, predecessor_index, weight}`` structs; the packed
reader gives back the triples either way, with the same digest.

Record fields that have no column here (a recovery segment's ``outcome_scope`` / ``task_outcome``,
SPEC §6.8, whose ``task_outcome`` is a number or ``"unverified"``) travel in Parquet as one JSON
string column, ``fields`` (:data:`EXTRA_COLUMN`).

Types only: no I/O (pyarrow is imported inside the functions, as by the writers).
"""

from __future__ import annotations

from typing import Any

from ledger.algorithms.errors import InputError

__all__ = ["EXTRA_COLUMN", "MEMBER_COLUMNS", "lineage_type", "packed_member_type", "packed_schema", "pair_schema", "path_schema",
           "schema_for", "schema_of_route", "target_type"]

EXTRA_COLUMN = "fields"  # Parquet: canonical JSON of a record's fields beyond its format's columns


def _ints():
    import pyarrow as pa  # cold path: pyarrow

    return pa.list_(pa.int64())


def lineage_type():
    """SPEC 11.2: a semantics-3 member's lineage object."""
    import pyarrow as pa  # cold path: pyarrow

    s = pa.string()
    return pa.struct([
        ("artifact_version", s), ("collection_id", s), ("collection_run_id", s), ("collection_version", pa.int64()),
        ("evaluator", s), ("fixture", s), ("route_version", pa.int64()),
        ("selection", pa.struct([("behavioral_role", s), ("policy", s), ("selection_id", s)])),
        ("semantics", pa.int64()), ("task_id", s),
        ("transformations", pa.list_(pa.struct([("execution_id", s), ("transformation", s)]))),
    ])


def path_schema(lineage: bool = False):
    """SPEC §7.3 path records (``lineage``: a semantics-3 route's records carry it, SPEC 11.2)."""
    import pyarrow as pa  # cold path: pyarrow

    s = pa.string()
    fields = [
        ("member_id", s), ("execution_id", s), ("task_id", s), ("group_id", s), ("split", s), ("route", s),
        ("leaf_request_id", s), ("role_class", s), ("input_ids", _ints()), ("target_mask", _ints()),
        ("behavior_logprobs", pa.list_(pa.float64())), ("loss_weight", pa.float64()),
        ("execution_target_tokens", pa.int64()), ("reward", pa.float64()), ("dummy", pa.bool_()), ("digest", s),
    ]
    return pa.schema(fields + ([("lineage", lineage_type())] if lineage else []))


def pair_schema(masks: bool = False, lineage: bool = False):
    """SPEC §6.9 preference pairs (``masks``, ``lineage``: semantics 3+, SPEC 11.5 / 11.2)."""
    import pyarrow as pa  # cold path: pyarrow

    s, f = pa.string(), pa.float64()
    fields = [
        ("member_id", s), ("execution_ids", pa.list_(s)), ("task_id", s), ("group_id", s), ("split", s), ("route", s),
        ("prompt_ids", _ints()), ("chosen_ids", _ints()), ("rejected_ids", _ints()),
        ("chosen_logprobs", pa.list_(f)), ("rejected_logprobs", pa.list_(f)), ("chosen_reward", f),
        ("rejected_reward", f), ("criterion", s), ("digest", s),
    ]
    if masks:
        fields[-1:-1] = [("chosen_mask", _ints()), ("rejected_mask", _ints())]  # before the digest
    if lineage:
        fields += [("lineage", lineage_type()), ("rejected_lineage", lineage_type())]
    return pa.schema(fields)


def target_type():
    """A packed target in Parquet: integers, a null predecessor where a target opens a path."""
    import pyarrow as pa  # cold path: pyarrow

    return pa.struct([("target_index", pa.int64()), ("predecessor_index", pa.int64()), ("weight", pa.float64())])


MEMBER_COLUMNS = ("member_id", "leaf_node_index", "digest", "leaf_request_id", "reward", "role_class", "lineage")


def packed_member_type(extras: bool = False, lineage: bool = False, fields_column: bool = False):
    """A packed record's member: ``{member_id, leaf_node_index}`` (SPEC §7.5) and, from semantics 3
    on (SPEC 11.5), what rebuilds its path record: ``digest``, ``reward``, ``leaf_request_id``,
    ``role_class`` (and ``lineage``; any further field as JSON in ``fields``)."""
    import pyarrow as pa  # cold path: pyarrow

    s = pa.string()
    fields = [("member_id", s), ("leaf_node_index", pa.int64())]
    if extras:
        fields += [("digest", s), ("leaf_request_id", s), ("reward", pa.float64()), ("role_class", s)]
    if lineage:
        fields.append(("lineage", lineage_type()))
    if fields_column:
        fields.append((EXTRA_COLUMN, s))
    return pa.struct(fields)


def packed_schema(extras: bool = False, lineage: bool = False, fields_column: bool = False):
    """SPEC §7.5 packed records; ``extras``: the SPEC 11.5 fields of a semantics-3 route's records."""
    import pyarrow as pa  # cold path: pyarrow

    s = pa.string()
    fields = [
        ("execution_id", s), ("input_ids", _ints()), ("position_ids", _ints()), ("node_spans", pa.list_(_ints())),
        ("tin", _ints()), ("tout", _ints()), ("targets", pa.list_(target_type())),
        ("members", pa.list_(packed_member_type(extras, lineage, fields_column))), ("digest", s),
    ]
    if extras:
        fields += [("task_id", s), ("group_id", s), ("split", s), ("route", s),
                   ("behavior_logprobs", pa.list_(pa.float64())), ("role_class", pa.list_(s))]
    return pa.schema(fields)


def schema_of_route(kind: str, semantics: int):
    """The schema of ``kind`` records of a route of ``semantics`` (a manifest's ``semantics``): from 3 on
    path and pair records carry lineage, pairs their masks, packed records the SPEC 11.5 fields."""
    like: dict[str, Any] = {}
    if semantics >= 3:
        like = {"path": {"lineage": {}}, "pair": {"chosen_mask": [], "lineage": {}},
                "packed": {"split": None, "members": [{"lineage": {}}]}}[kind]
    return schema_for(kind, like)


def schema_for(kind: str, rec: dict[str, Any] | None = None):
    """The schema of ``kind`` (``path``, ``pair`` or ``packed``) for records shaped like ``rec``
    (the first record of an export: which optional fields the route's records carry)."""
    rec = rec or {}
    if kind == "path":
        return path_schema(lineage="lineage" in rec)
    if kind == "pair":
        return pair_schema(masks="chosen_mask" in rec, lineage="lineage" in rec)
    if kind == "packed":
        member = (rec.get("members") or [{}])[0]
        return packed_schema(extras="split" in rec, lineage="lineage" in member,
                             fields_column=bool(set(member) - set(MEMBER_COLUMNS)))
    raise InputError(f"unknown record kind {kind!r} (path, pair, packed)")
