"""One error root (SPEC 12.5): every exception class in ``ledger`` is a ``ledger.LedgerError``,
says its meaning through ``InputError`` / ``IntegrityError`` / ``StateError``, keeps the builtin
base callers caught before (``ValueError`` / ``RuntimeError``), and no two classes share a name."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import ledger
from ledger import InputError, IntegrityError, LedgerError, StateError

# The edges are being re-rooted on their own branches (issue 43 item 7); drop this once they are.
EDGES: tuple[str, ...] = ()  # every package is checked, the CLI, gateway and view edges included


def _exception_classes() -> dict[str, list[type]]:
    found: dict[str, list[type]] = {}
    for info in pkgutil.walk_packages(ledger.__path__, "ledger."):
        if info.name.endswith("__main__"):
            continue
        try:
            mod = importlib.import_module(info.name)
        except ImportError as exc:  # an optional extra (torch) that is not installed
            if exc.name and exc.name.split(".")[0] != "ledger":
                continue
            raise
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == mod.__name__:
                found.setdefault(obj.__name__, [])
                if obj not in found[obj.__name__]:
                    found[obj.__name__].append(obj)
    return found


CLASSES = _exception_classes()


def test_no_two_exception_classes_share_a_name():
    assert {name: [c.__module__ for c in cs] for name, cs in CLASSES.items() if len(cs) > 1} == {}


def test_every_exception_class_is_a_ledger_error():
    outside = sorted(f"{c.__module__}.{c.__qualname__}" for cs in CLASSES.values() for c in cs
                     if not c.__module__.startswith(EDGES) and not issubclass(c, LedgerError))
    assert outside == []
    assert len([c for cs in CLASSES.values() for c in cs if not c.__module__.startswith(EDGES)]) >= 40


# (module, class): (meaning, the builtin base it had before; callers' ``except`` keeps catching it)
MEANING = {
    ("ledger.algorithms.canonical", "DuplicateKeyError"): (InputError, ValueError),
    ("ledger.algorithms.checkpoint", "NoteError"): (IntegrityError, ValueError),
    ("ledger.algorithms.merkle", "ProofError"): (IntegrityError, ValueError),
    ("ledger.algorithms.prefix_match", "PrefixReferenceError"): (InputError, ValueError),
    ("ledger.algorithms.split_hash", "SplitPolicyError"): (InputError, ValueError),
    ("ledger.events.codec", "CodecError"): (InputError, ValueError),
    ("ledger.events.validate", "ValidationError"): (InputError, ValueError),
    ("ledger.events.signing", "SignatureError"): (IntegrityError, ValueError),
    ("ledger.log.base", "LogError"): (StateError, RuntimeError),
    ("ledger.log.base", "CorruptStore"): (StateError, RuntimeError),
    ("ledger.log.paths", "OriginError"): (StateError, RuntimeError),
    ("ledger.log.sealing", "SealError"): (IntegrityError, ValueError),
    ("ledger.log.sealing", "KeyDestroyed"): (IntegrityError, ValueError),
    ("ledger.projections.engine", "Rejected"): (InputError, Exception),
    ("ledger.projections.shards", "MergeError"): (StateError, RuntimeError),
    ("ledger.producers.ingest", "IngestError"): (InputError, ValueError),
    ("ledger.producers.credit_client", "CreditError"): (StateError, RuntimeError),
    ("ledger.producers.credit_client", "CreditTimeout"): (StateError, RuntimeError),
    ("ledger.producers.recorder", "RecorderError"): (StateError, RuntimeError),
    ("ledger.corpus.records", "DigestMismatch"): (IntegrityError, ValueError),
    ("ledger.corpus.records", "MemberSetMismatch"): (IntegrityError, ValueError),
    ("ledger.corpus.records", "RecordError"): (InputError, ValueError),
    ("ledger.corpus.packed", "PackedDigestMismatch"): (IntegrityError, ValueError),
    ("ledger.corpus.packed", "PackedRecordError"): (InputError, ValueError),
    ("ledger.corpus.manifest", "ManifestDigestMismatch"): (IntegrityError, ValueError),
    ("ledger.corpus.manifest", "ManifestMemberSetMismatch"): (IntegrityError, ValueError),
    ("ledger.corpus.publish", "PublishError"): (InputError, ValueError),
    ("ledger.corpus.feed", "FeedError"): (InputError, ValueError),
    ("ledger.corpus.withdraw", "EraseRefused"): (InputError, ValueError),
    ("ledger.corpus.atif_export", "AtifExportError"): (InputError, ValueError),
    ("ledger.corpus.projection_check", "ProjectionMismatch"): (IntegrityError, Exception),
    ("ledger.corpus.canary_scan", "CanaryEscaped"): (IntegrityError, Exception),
}


@pytest.mark.parametrize(("module", "name"), sorted(MEANING))
def test_meaning_and_builtin_base(module, name):
    cls = getattr(importlib.import_module(module), name)
    meaning, builtin = MEANING[(module, name)]
    assert issubclass(cls, meaning) and issubclass(cls, builtin) and issubclass(cls, LedgerError)
    others = {InputError, IntegrityError, StateError} - {meaning}
    assert not any(issubclass(cls, o) for o in others), cls.__mro__


def test_family_roots_and_renamed_classes():
    from ledger.corpus import manifest as M
    # ReadError / ManifestError are family roots: each raise below them says its meaning
    assert issubclass(ledger.ReadError, LedgerError) and issubclass(ledger.ReadError, ValueError)
    assert issubclass(M.ManifestError, LedgerError) and issubclass(M.ManifestError, ValueError)
    assert issubclass(M.ManifestDigestMismatch, ledger.DigestMismatch)
    assert issubclass(M.ManifestMemberSetMismatch, ledger.MemberSetMismatch)
    assert not hasattr(M, "DigestMismatch") and not hasattr(M, "MemberSetMismatch")
    try:
        from ledger.train import data
    except ImportError:  # pragma: no cover - the [train] extra
        return
    assert data.ManifestError is data.ManifestReadError and data.ManifestReadError.__name__ == "ManifestReadError"
    assert issubclass(data.MemberSetError, M.ManifestMemberSetMismatch)
