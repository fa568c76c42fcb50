"""Crypto-shredding of token payloads (SPEC §6.4 ``erase``).

Token payloads of a request can be **sealed** before submission: the event keeps its
identity and metadata in the clear, but ``input_ids`` / ``input_suffix_ids`` /
``output_ids`` / ``output_logprobs`` are emptied and an AES-GCM ciphertext holding them
goes into the ``sealed`` field (schema ``RequestRecorded.v2``).  The key is a per-subject
*data key* kept **outside the log**, in the store's ``data-keys.db`` (``KeyStore``).
Erasure destroys the key: the log's bytes, digests and Merkle roots do not change, so
every audit still verifies, but the ciphertext can no longer be opened.

* ``KeyStore(path)``: ``key_for(subject)`` (creates the key on first use), ``key_by_id``,
  ``destroy(subject)`` (idempotent; leaves a tombstone so the subject is never silently
  re-keyed), ``destroyed(subject)``.
* ``seal_request(event, keystore, subject)``: a validated request event record -> the
  sealed record to submit (``Ingestor.submit``).  Sealing is deterministic (synthetic
  nonce), so a retried submission is byte-identical and stays idempotent.
* ``unseal(event, keystore)``: the plain event (``sealed`` = None, tokens restored), the
  event itself if it was never sealed, or ``None`` when its key has been destroyed.

Plaintext layout (inside the ciphertext): version byte ``0x01`` then the Avro binary of
record ``SealedPayload {input_ids: [null, bytes], input_suffix_ids: [null, bytes],
output_ids: bytes, output_logprobs: [null, bytes]}``.  The AES-GCM associated data is the
canonical JSON of ``{"execution_id", "request_id", "key_id", "v": 1}``, so a ciphertext
cannot be moved to another request.

Sealing is the **default** of the ingest path (``ledger.producers.ingest.Ingestor``: per
execution unless told otherwise, keys in the store's ``data-keys.db``, see
:func:`store_keys_path`).  A prefix reference into a sealed request is verified by opening
it with the store's key store; only when its key was destroyed (erased) or no key store is
available is the reference refused.  Replay finds the store's keys the same way
(:func:`bind_store_keystore`, called by the replay engine).

Limits (by design): only token payloads are sealed: tool payloads, metadata, features,
evidence and the replacement tokens of a ``record_derived`` stay readable (so erasure
refuses to cover a derived view that replaces tokens, see ``ledger.corpus.withdraw``).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import secrets
import sqlite3
from dataclasses import dataclass
from json.encoder import encode_basestring as _json_str  # the C escaper json.dumps(ensure_ascii=False) uses
from pathlib import Path
from typing import Iterable

import fastavro
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ledger.algorithms.canonical import canonical_json
from ledger.algorithms.errors import InputError, IntegrityError
from ledger.events.catalog import key_of
from ledger.log.paths import store_paths
from ledger.events.codec import default_codec

__all__ = ["KeyStore", "KeyCache", "DataKey", "SealError", "KeyDestroyed", "seal_request", "unseal", "is_sealed", "sealed_key_id",
           "store_keys_path", "StoreKeyStore", "bind_store_keystore", "Sealer"]

_VERSION = b"\x01"
_PAYLOAD_SCHEMA = fastavro.parse_schema({
    "type": "record", "name": "SealedPayload", "namespace": "ledger.internal", "fields": [
        {"name": "input_ids", "type": ["null", "bytes"], "default": None},
        {"name": "input_suffix_ids", "type": ["null", "bytes"], "default": None},
        {"name": "output_ids", "type": "bytes"},
        {"name": "output_logprobs", "type": ["null", "bytes"], "default": None}]})
_SEALED_FIELDS = ("input_ids", "input_suffix_ids", "output_ids", "output_logprobs")
_KEYS_SCHEMA = """
CREATE TABLE IF NOT EXISTS data_keys (subject TEXT PRIMARY KEY, key_id TEXT NOT NULL UNIQUE, key BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS destroyed_keys (key_id TEXT PRIMARY KEY, subject TEXT NOT NULL, reason TEXT);
CREATE INDEX IF NOT EXISTS destroyed_subject ON destroyed_keys(subject);
"""


class SealError(IntegrityError):
    """An event cannot be sealed or a ciphertext does not open under its key."""


class KeyDestroyed(SealError):
    """The subject's data key was destroyed (erased); nothing new is sealed under it."""


@dataclass(frozen=True)
class DataKey:
    subject: str
    key_id: str
    key: bytes  # 32 bytes; never written to the log, a manifest or a projection database

    def __repr__(self) -> str:  # keep key bytes out of logs and tracebacks
        return f"DataKey(subject={self.subject!r}, key_id={self.key_id!r})"


class KeyStore:
    """Per-subject AES-256 data keys in a SQLite file outside the log (``data-keys.db``).

    The file is created readable by its owner only.  ``secure_delete`` overwrites a
    destroyed key's bytes in the database file and the rollback journal (no WAL, which
    would keep old pages around).  Copies outside this file (backups, snapshots, a
    process that read the key earlier) are outside what destruction can reach.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=DELETE")
        self.db.execute("PRAGMA secure_delete=ON")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA busy_timeout=30000")
        self.db.executescript(_KEYS_SCHEMA)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "KeyStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ keys
    def key_for(self, subject: str, *, create: bool = True) -> DataKey:
        """The subject's data key, created on first use; raises :class:`KeyDestroyed` after erasure."""
        row = self.db.execute("SELECT key_id, key FROM data_keys WHERE subject = ?", (subject,)).fetchone()
        if row is not None:
            return DataKey(subject, row[0], bytes(row[1]))
        if self.destroyed(subject):
            raise KeyDestroyed(f"the data key of {subject} was destroyed (erased); refusing to seal new records under it")
        if not create:
            raise KeyError(subject)
        self.create_keys([subject])
        return self.key_for(subject, create=False)

    def create_keys(self, subjects: Iterable[str]) -> None:
        """Create the data keys of ``subjects`` that have none (destroyed ones stay destroyed) in one
        transaction: one synced commit (~4 syncs in this journal mode) for a batch of new executions,
        not one per execution (issue 29: they were on the group commit's critical path)."""
        missing = [s for s in dict.fromkeys(subjects) if not self._has_key(s) and not self.destroyed(s)]
        if not missing:
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.executemany("INSERT OR IGNORE INTO data_keys VALUES (?,?,?)",
                                [(s, secrets.token_hex(16), secrets.token_bytes(32)) for s in missing])
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def _has_key(self, subject: str) -> bool:
        return self.db.execute("SELECT 1 FROM data_keys WHERE subject = ?", (subject,)).fetchone() is not None

    def key_by_id(self, key_id: str) -> bytes | None:
        """The key bytes for ``key_id``, or ``None`` when it was destroyed or never existed here."""
        row = self.db.execute("SELECT key FROM data_keys WHERE key_id = ?", (key_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def subject_of(self, key_id: str) -> str | None:
        row = self.db.execute("SELECT subject FROM data_keys WHERE key_id = ? UNION ALL "
                              "SELECT subject FROM destroyed_keys WHERE key_id = ?", (key_id, key_id)).fetchone()
        return None if row is None else row[0]

    def subjects(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT subject FROM data_keys ORDER BY subject")]

    def destroyed(self, subject: str) -> bool:
        return self.db.execute("SELECT 1 FROM destroyed_keys WHERE subject = ?", (subject,)).fetchone() is not None

    def destroy(self, subject: str, reason: str | None = None) -> str | None:
        """Destroy the subject's key (idempotent).  Returns its key id, or ``None`` if it had none."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute("SELECT key_id FROM data_keys WHERE subject = ?", (subject,)).fetchone()
            if row is None:
                self.db.execute("COMMIT")
                return None
            self.db.execute("DELETE FROM data_keys WHERE subject = ?", (subject,))
            self.db.execute("INSERT OR IGNORE INTO destroyed_keys VALUES (?,?,?)", (row[0], subject, reason))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("VACUUM")  # rewrite the file so no free page keeps the old key
        return row[0]


# ---------------------------------------------------------------------- sealing
def _subkeys(key: bytes) -> tuple[bytes, bytes]:
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=b"ledger data key v1").derive(key)
    return okm[:32], okm[32:]


def _aad(event: dict, key_id: str) -> bytes:
    ex, rid = event["execution_id"], event["request_id"]
    if type(ex) is str and type(rid) is str and type(key_id) is str:
        # = canonical_json of the dict below (sorted keys, no spaces, ensure_ascii=False, whose string
        # escaping is exactly json.encoder.encode_basestring), without the encoder's dict walk (issue 19;
        # tests/test_perf_paths.py compares the two)
        return ('{"execution_id":%s,"key_id":%s,"request_id":%s,"v":1}'
                % (_json_str(ex), _json_str(key_id), _json_str(rid))).encode("utf-8")
    return canonical_json({"execution_id": ex, "request_id": rid, "key_id": key_id, "v": 1})


class KeyCache:
    """A key store's ``key_by_id`` memoised, with the derived AES-GCM cipher per key: what a replay
    hands :func:`unseal` so one batch's requests under one key cost one key-store query and one
    HKDF derivation, not one each (issue 19).  The owner calls :meth:`clear` at every batch
    boundary, so a key destroyed meanwhile is seen by the next batch and nothing derived from it
    outlives the batch."""

    def __init__(self, keystore) -> None:
        self.keystore = keystore
        self._keys: dict[str, bytes | None] = {}
        self._ciphers: dict[bytes, AESGCM] = {}

    def key_by_id(self, key_id: str) -> bytes | None:
        try:
            return self._keys[key_id]
        except KeyError:
            key = self._keys[key_id] = self.keystore.key_by_id(key_id)
            return key

    def cipher(self, key: bytes) -> AESGCM:
        c = self._ciphers.get(key)
        if c is None:
            c = self._ciphers[key] = AESGCM(_subkeys(key)[0])
        return c

    def clear(self) -> None:
        self._keys.clear()
        self._ciphers.clear()


def is_sealed(event: dict) -> bool:
    return event.get("sealed") is not None


def sealed_key_id(event: dict) -> str | None:
    s = event.get("sealed")
    return None if s is None else s["key_id"]


def seal_request(event: dict, keystore: KeyStore, subject: str) -> dict:
    """Return a copy of a validated ``request`` event record with its tokens sealed under ``subject``'s key.

    The nonce is synthetic (HMAC of the associated data and plaintext under a derived key),
    so sealing the same event twice gives identical bytes: retries stay idempotent, and a
    nonce is never reused for a different plaintext."""
    if event.get("event_type") != "request":
        raise SealError(f"only request events are sealed, not {event.get('event_type')!r}")
    if is_sealed(event):
        raise SealError(f"request {event['request_id']!r} is already sealed")
    dk = keystore.key_for(subject)
    return _seal_with(event, dk, _subkeys(dk.key))


def _seal_with(event: dict, dk: DataKey, subkeys: tuple[bytes, bytes]) -> dict:
    buf = io.BytesIO()
    buf.write(_VERSION)
    fastavro.schemaless_writer(buf, _PAYLOAD_SCHEMA, {k: event.get(k) for k in _SEALED_FIELDS})
    plaintext = buf.getvalue()
    enc_key, nonce_key = subkeys
    aad = _aad(event, dk.key_id)
    mac = hmac.new(nonce_key, aad, hashlib.sha256)
    mac.update(plaintext)  # = HMAC(aad + plaintext), without copying the payload into one more buffer
    nonce = mac.digest()[:12]
    ciphertext = AESGCM(enc_key).encrypt(nonce, plaintext, aad)
    out = dict(event)
    has_prefix = event.get("input_prefix") is not None
    out.update(input_ids=None if has_prefix else b"", input_suffix_ids=b"" if has_prefix else None,
               output_ids=b"", output_logprobs=None,
               sealed={"key_id": dk.key_id, "nonce": nonce, "ciphertext": ciphertext})
    return out


def unseal(event: dict, keystore: KeyStore) -> dict | None:
    """The event with its tokens restored; the event unchanged if not sealed; ``None`` if erased.

    Raises :class:`SealError` when the key exists but the ciphertext does not open (wrong
    key store, or bytes altered — which ``ledger audit`` would also report)."""
    sealed = event.get("sealed")
    if sealed is None:
        return event
    key = keystore.key_by_id(sealed["key_id"])
    if key is None:
        return None
    cipher = keystore.cipher(key) if type(keystore) is KeyCache else AESGCM(_subkeys(key)[0])
    try:
        plaintext = cipher.decrypt(bytes(sealed["nonce"]), bytes(sealed["ciphertext"]), _aad(event, sealed["key_id"]))
    except InvalidTag:
        raise SealError(f"sealed payload of request {event.get('request_id')!r} does not open under key "
                        f"{sealed['key_id']}") from None
    if plaintext[:1] != _VERSION:
        raise SealError(f"unknown sealed payload version {plaintext[:1].hex()}")
    payload = fastavro.schemaless_reader(io.BytesIO(plaintext[1:]), _PAYLOAD_SCHEMA)
    out = dict(event)
    out.update(payload)
    out["sealed"] = None
    return out


# ---------------------------------------------------------------------- producer helpers
SEAL_LEVELS = ("execution", "task", "source")


class SubjectResolver:
    """Maps a request to the subject whose key seals it: ``execution:ID`` (default, finest
    grain: erasing any covering subject destroys it), ``task:ID`` or ``source:ID``.

    Task and source are looked up in the batch being sealed first, then in the log
    (``execution_opened`` / ``task_registered`` by natural key)."""

    def __init__(self, level: str = "execution", log=None, codec=None) -> None:
        if level not in SEAL_LEVELS:
            raise InputError(f"seal level must be one of {', '.join(SEAL_LEVELS)}, got {level!r}")
        self.level, self.log, self.codec = level, log, codec
        self.tasks: dict[str, str] = {}
        self.sources: dict[str, str | None] = {}

    def observe(self, ev: dict) -> None:
        if ev["event_type"] == "execution_opened":
            self.tasks.setdefault(ev["execution_id"], ev["task_id"])
        elif ev["event_type"] == "task_registered":
            self.sources.setdefault(ev["task_id"], ev.get("source"))

    def _lookup(self, natural_key: str) -> dict | None:
        if self.log is None:
            return None
        rec = self.log.lookup(natural_key)
        if rec is None:
            return None

        return (self.codec or default_codec()).decode(rec.value)

    def __call__(self, ev: dict) -> str:
        ex = ev["execution_id"]
        if self.level == "execution":
            return f"execution:{ex}"
        task = self.tasks.get(ex)
        if task is None:
            opened = self._lookup(key_of("execution_opened", execution_id=ex))
            if opened is None:
                raise SealError(f"cannot seal per {self.level}: execution {ex!r} was never opened")
            task = self.tasks.setdefault(ex, opened["task_id"])
        if self.level == "task":
            return f"task:{task}"
        if task not in self.sources:
            reg = self._lookup(key_of("task_registered", task_id=task))
            self.sources[task] = None if reg is None else reg.get("source")
        source = self.sources[task]
        if source is None:
            raise SealError(f"cannot seal per source: task {task!r} has no registered source")
        return f"source:{source}"


def seal_events(events: list[dict], keystore: KeyStore, subject_for) -> list[dict]:
    """Seal every request record of a batch of validated event records (others pass through)."""
    out = []
    for ev in events:
        if hasattr(subject_for, "observe"):
            subject_for.observe(ev)
        out.append(seal_request(ev, keystore, subject_for(ev)) if ev["event_type"] == "request" else ev)
    return out


class Sealer:
    """The seal step of one ingest batch: seals ``request`` records under ``subject_for(ev)``'s key.

    Keys and derived subkeys are looked up once per subject per batch (never cached across
    batches, so a key destroyed by another process is never used again by a long-lived
    producer after its current batch)."""

    def __init__(self, keystore: "KeyStore", subject_for) -> None:
        self.keystore, self.subject_for = keystore, subject_for
        self._keys: dict[str, tuple[DataKey, tuple[bytes, bytes]]] = {}

    def observe(self, ev: dict) -> None:
        if hasattr(self.subject_for, "observe"):
            self.subject_for.observe(ev)

    def prepare(self, events: Iterable[dict]) -> None:
        """Create the missing keys of every subject the batch's unsealed requests need, at once
        (what cannot be resolved here is left for :meth:`seal` to report)."""
        subjects = []
        for ev in events:
            self.observe(ev)
            if ev.get("event_type") == "request" and not is_sealed(ev):
                try:
                    subjects.append(self.subject_for(ev))
                except SealError:
                    continue
        self.keystore.create_keys(s for s in subjects if s not in self._keys)

    def seal(self, ev: dict) -> dict:
        if ev.get("event_type") != "request" or is_sealed(ev):
            return ev
        subject = self.subject_for(ev)
        got = self._keys.get(subject)
        if got is None:
            dk = self.keystore.key_for(subject)
            got = self._keys[subject] = (dk, _subkeys(dk.key))
        return _seal_with(ev, *got)


# ---------------------------------------------------------------------- the store's key store
def store_keys_path(url: str) -> Path:
    """Where the store at ``url`` keeps its data keys (``ledger.log.paths.StorePaths.data_keys``):
    ``<store>/data-keys.db`` for an embedded store, ``./data-keys.db`` for Kafka."""

    return Path(store_paths(url).data_keys)


class StoreKeyStore:
    """A store's key store, opened on first use (a replay that meets no sealed request opens
    no file, and one started before the first sealed ingestion still finds the keys later).

    Only reading is offered (``key_by_id``, ``subject_of``, ``destroyed``): replay never
    creates a key.  When the file does not exist (yet), ``key_by_id`` raises
    :class:`SealError` ``"sealed request: no key store configured"``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._ks: KeyStore | None = None

    def _open(self) -> KeyStore:
        if self._ks is None:
            if not self.path.exists():
                raise SealError("sealed request: no key store configured")
            self._ks = KeyStore(self.path)
        return self._ks

    def key_by_id(self, key_id: str) -> bytes | None:
        return self._open().key_by_id(key_id)

    def subject_of(self, key_id: str) -> str | None:
        return self._open().subject_of(key_id)

    def destroyed(self, subject: str) -> bool:
        return self._open().destroyed(subject)

    def close(self) -> None:
        if self._ks is not None:
            self._ks.close()
            self._ks = None


def bind_store_keystore(projections, log=None, *, url: str | None = None) -> None:
    """Give every projection that reads sealed requests and has no key store (attribute
    ``keystore`` is ``None``) the store's own, opened lazily (:class:`StoreKeyStore`).  The
    store is ``url`` or ``log.url``; a log without a ``url`` (a test double) gets nothing."""
    url = url if url is not None else getattr(log, "url", None)
    if not isinstance(url, str):
        return
    lazy = None
    for p in projections:
        if getattr(p, "keystore", False) is None:
            lazy = lazy or StoreKeyStore(store_keys_path(url))
            p.keystore = lazy
