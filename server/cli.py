"""The ``coliworker`` command: serve, info, stats, demo, top, health.

    coliworker serve [--host H] [--port P] [--backend auto|numpy|cupy] [--devices 0,1] ...
    coliworker info  [--address HOST:PORT]
    coliworker stats [--address HOST:PORT]
    coliworker demo  [--address HOST:PORT] [--layers N] [--tokens N]
    coliworker top   [--metrics-url URL] [--interval S] [--once]
    coliworker health [--address HOST:PORT] [--service NAME]

Every ``serve`` flag has a ``COLIWORKER_*`` environment variable (``coliworker serve -h``).
The client commands take the worker's address from ``--address``, else
``COLIWORKER_ADDRESS``, else 127.0.0.1:50051; ``top`` its URL from ``--metrics-url``, else
``COLIWORKER_METRICS_URL``, else http://127.0.0.1:9400/metrics.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys

from coliworker import __version__
from coliworker.server import config as cfg

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_METRICS_URL = "http://127.0.0.1:9400/metrics"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Python's own wording for a number that did not parse, and what the operator should read.
_NOT_A_NUMBER = (
    (re.compile(r"invalid literal for int\(\) with base 10: (.*)"), "expected an integer, got {}"),
    (re.compile(r"could not convert string to float: (.*)"), "expected a number, got {}"),
)


def _plain(message: str) -> str:
    """A settings error as the operator should read it ("--port: expected an integer, got
    'abc'", not Python's "invalid literal for int() with base 10")."""
    for pattern, wording in _NOT_A_NUMBER:
        m = pattern.search(message)
        if m:
            return message[: m.start()] + wording.format(m.group(1))
    return message


def _check_log_level(args: argparse.Namespace, level: str) -> str | None:
    """An error naming the flag or variable when ``level`` is not a logging level."""
    if level in LOG_LEVELS:
        return None
    source = (
        "--log-level" if getattr(args, "log_level", None) is not None else "COLIWORKER_LOG_LEVEL"
    )
    return f"{source}: expected one of {', '.join(LOG_LEVELS)}, got {level!r}"


def _serve(args: argparse.Namespace) -> int:
    try:
        config = cfg.from_sources(args, os.environ)
    except ValueError as exc:
        print(f"coliworker serve: {_plain(str(exc))}", file=sys.stderr)
        return 2
    problem = _check_log_level(args, config.log_level)
    if problem:
        print(f"coliworker serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from coliworker.server.app import build_server

    try:
        server = build_server(config, handle_signals=True).start()
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"coliworker serve: {exc}", file=sys.stderr)
        return 1
    signum = server.wait_for_signal()  # caught from before the port opened (app.py)
    logging.getLogger("coliworker").info("signal %d: draining", signum)
    server.stop(grace=config.drain_grace)
    return 0


def _client_options(args: argparse.Namespace) -> dict:
    """WorkerClient keyword arguments from the connection flags (token, TLS)."""
    from coliworker.client.security import TLS

    opts: dict = {}
    if args.token_file:
        with open(args.token_file) as f:
            opts["token"] = f.read().strip()
    if args.ca or args.cert or args.key or args.server_name or args.tls:
        opts["tls"] = TLS(ca=args.ca, cert=args.cert, key=args.key, server_name=args.server_name)
    return opts


def _info(args: argparse.Namespace) -> int:
    from coliworker.client import WorkerClient, WorkerError

    try:
        with WorkerClient(args.address, timeout=10, **_client_options(args)) as w:
            info = w.info()
    except WorkerError as exc:
        print(f"coliworker info: {args.address}: {exc}", file=sys.stderr)
        return 1
    print(
        f"coliworker {info.version} at {args.address}, backend {info.backend}, "
        f"instance {info.instance_id}"
    )
    for d in info.devices:
        limit = f", budget {d.memory_limit_bytes / 2**30:.1f} GiB" if d.memory_limit_bytes else ""
        print(
            f"  device {d.id}: {d.name}, {d.free_memory_bytes / 2**30:.1f} of "
            f"{d.total_memory_bytes / 2**30:.1f} GiB free{limit}"
        )
    for k, v in info.limits.items():
        print(f"  {k} = {v}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from coliworker.client import WorkerClient, WorkerError

    try:
        with WorkerClient(args.address, timeout=10, **_client_options(args)) as w:
            stats = w.stats()
    except WorkerError as exc:
        print(f"coliworker stats: {args.address}: {exc}", file=sys.stderr)
        return 1
    print(
        "device  tensors  tensor_MB  handles  kv_seqs  kv_MB  group_calls  experts  rows  "
        "h2d_ms  kernel_ms  d2h_ms"
    )
    for d in stats:
        g = d.group
        print(
            f"{d.device:>6}  {d.tensors:>7}  {d.tensor_bytes / 1e6:>9.1f}  {d.handles:>7}  "
            f"{d.kv_sequences:>7}  {d.kv_bytes / 1e6:>5.1f}  {g.calls:>11}  {g.experts:>7}  "
            f"{g.rows:>4}  {g.h2d_ns / 1e6:>6.1f}  {g.kernel_ns / 1e6:>9.1f}  "
            f"{g.d2h_ns / 1e6:>6.1f}"
        )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from coliworker.tools.demo import run_demo

    return run_demo(
        args.address,
        layers=args.layers,
        tokens=args.tokens,
        seed=args.seed,
        **_client_options(args),
    )


def _top(args: argparse.Namespace) -> int:
    from coliworker.tools.top import run_top

    return run_top(args.metrics_url, interval=args.interval, once=args.once)


def _health(args: argparse.Namespace) -> int:
    from coliworker.tools.health import probe

    tls = _client_options(args).get("tls")
    return probe(args.address, service=args.service, tls=tls)


def _add_connection(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=os.environ.get("COLIWORKER_ADDRESS") or DEFAULT_ADDRESS,
        help="worker host:port or unix:PATH (default: $COLIWORKER_ADDRESS, else "
        f"{DEFAULT_ADDRESS})",
    )
    p.add_argument("--token-file", help="file holding the bearer token (worker --token-file)")
    p.add_argument("--tls", action="store_true", help="use TLS with the system's roots")
    p.add_argument("--ca", help="PEM file of the roots that signed the worker's certificate")
    p.add_argument("--cert", help="client certificate PEM (mutual TLS)")
    p.add_argument("--key", help="client key PEM (mutual TLS)")
    p.add_argument("--server-name", help="name to check the worker's certificate against")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="coliworker",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"coliworker {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the worker",
        description="Run the worker. Every flag falls back to its "
        "COLIWORKER_* environment variable, then to the default.",
    )
    cfg.add_arguments(serve)
    serve.set_defaults(func=_serve)

    for name, func, text in (
        ("info", _info, "show a worker's version, devices and limits"),
        ("stats", _stats, "show residency and expert-group totals"),
        ("health", _health, "exit 0 when the worker's health is SERVING"),
    ):
        c = sub.add_parser(name, help=text)
        _add_connection(c)
        c.set_defaults(func=func)
        if name == "health":
            c.add_argument(
                "--service",
                default="",
                help="service to ask about: '' (the server, default) or coliworker.v1.Worker "
                "(NOT_SERVING while draining)",
            )

    demo = sub.add_parser(
        "demo", help="run a small GLM-style decode loop against a worker and check it against NumPy"
    )
    _add_connection(demo)
    demo.add_argument("--layers", type=int, default=3, help="MoE layers (default 3)")
    demo.add_argument("--tokens", type=int, default=6, help="tokens to decode (default 6)")
    demo.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    demo.set_defaults(func=_demo)

    top = sub.add_parser("top", help="live view of a worker's metrics")
    top.add_argument(
        "--metrics-url",
        default=os.environ.get("COLIWORKER_METRICS_URL") or DEFAULT_METRICS_URL,
        help="the worker's /metrics URL or host:port (default: $COLIWORKER_METRICS_URL, else "
        f"{DEFAULT_METRICS_URL})",
    )
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit")
    top.set_defaults(func=_top)
    return p


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    commands = _commands(parser)
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        close = difflib.get_close_matches(argv[0], commands, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        print(
            f"coliworker: unknown command {argv[0]!r}; {hint}commands: {', '.join(commands)} "
            "(coliworker COMMAND -h for one's flags)",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    return int(args.func(args))
