"""Events: the Avro codec, the event catalog, JSON-lines validation and governance signatures.

``codec`` (Avro single-object encoding over the schemas shipped with the package),
``catalog`` (JSON type <-> Avro record, partition keys, natural keys, which types are
governance), ``validate`` (JSON lines -> event records, errors name line and field), ``lines``
(its inverse: a stored event back to its ingest line, ``ledger events``),
``signing`` (Ed25519 keys, key ids, the trust file, governance signatures).

May import: ``ledger.algorithms``. Not the log backends, projections or anything above.
"""
