"""The ``kvtiers`` command line.

Each subcommand is one :class:`Command` in :data:`COMMANDS`: a function that adds its
arguments to its parser and a function that runs it and returns the exit status. A
command imports what it needs inside its ``run`` so ``kvtiers --help`` stays fast.

Exit statuses: 0 success; 2 a configuration or usage error (bad arguments included); 1 any
other failure kvtiers reports (:class:`~kvtiers.errors.KVTiersError`: e.g. a location with
no kvtiers store in it). Reports go to stdout, problems to stderr as one line, never as a
traceback; a reader that closes the pipe early (``| head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

from kvtiers import __version__
from kvtiers.errors import ConfigError, KVTiersError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: A closed output pipe, as a shell reports a process ended by SIGPIPE (128 + 13).
EXIT_PIPE = 141


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, argument set-up and body."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _add_json(parser: argparse.ArgumentParser,
              meaning: str = "print one JSON document instead of text") -> None:
    parser.add_argument("--json", action="store_true", help=meaning)


def _one_line(text: str) -> str:
    from kvtiers.tools.text import visible

    return visible(" ".join(text.split()))


def _configure_validate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML stack files to check")
    _add_json(parser)


def _report_files(
    args: argparse.Namespace, one: Callable[[str], tuple[dict[str, Any], bool]]
) -> int:
    """Run ``one`` on each of ``args.files``: it prints the file's lines (unless
    ``--json``) and answers its JSON entry and whether it is good. Exit status 2 when one
    is not; with ``--json``, one document on stdout."""
    import json

    report = []
    status = EXIT_OK
    for name in args.files:
        entry, good = one(name)
        report.append(entry)
        if not good:
            status = EXIT_USAGE
    if args.json:
        json.dump({"ok": status == EXIT_OK, "files": report}, sys.stdout, indent=2,
                  ensure_ascii=False)
        print()
    return status


def _run_validate(args: argparse.Namespace) -> int:
    """Check each stack file; one line per file, on stdout if good, on stderr if not
    (with ``--json``, one document on stdout)."""
    from kvtiers.config import load_stack_config

    def one(name: str) -> tuple[dict[str, Any], bool]:
        try:
            stack = load_stack_config(name)
        except ConfigError as exc:
            # The error's source names the file (and line): ``<file>:<line>: <path>: …``.
            line = _one_line(str(exc))
            if not args.json:
                print(line, file=sys.stderr)
            return {"file": name, "ok": False, "path": exc.path, "error": line}, False
        if not args.json:
            print(f"{name}: ok — {stack.summary()}")
        return {"file": name, "ok": True, "summary": stack.summary()}, True

    return _report_files(args, one)


def _configure_check(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run every start-time check of stack files without starting anything: S3 "
        "credentials and bucket, write permission under each S3 prefix and in each file "
        "root (a probe file or object, removed again), free space, room in /dev/shm for a "
        "cpu tier placed there, the metrics port, and with a model: section an existing "
        "namespace's manifest. One line per finding, naming the YAML key; exit status 2 "
        "when a start would fail. An engine runs the same checks before it builds a stack."
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML stack files to check")
    _add_json(parser)


def _run_check(args: argparse.Namespace) -> int:
    """Validate, then preflight, each stack file; problems on stderr, exit 2 if any."""
    from kvtiers.config import load_stack_config
    from kvtiers.stack.preflight import preflight

    def one(name: str) -> tuple[dict[str, Any], bool]:
        try:
            stack = load_stack_config(name)
        except ConfigError as exc:
            findings = [{"severity": "problem", "path": exc.path,
                         "message": _one_line(exc.message), "line": _one_line(str(exc))}]
        else:
            identity = None if stack.model is None else stack.model.to_offloading_config()
            findings = [{"severity": f.severity, "path": f.path,
                         "message": _one_line(f.message), "line": _one_line(f.line(name))}
                        for f in preflight(stack, identity)]
        problems = [f for f in findings if f["severity"] == "problem"]
        if not args.json:
            for finding in findings:
                print(finding["line"], file=sys.stderr if finding in problems else sys.stdout)
            if not problems:
                print(f"{name}: ok — ready to start")
        return {"file": name, "ok": not problems, "findings": findings}, not problems

    return _report_files(args, one)


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    from kvtiers.config.examples import DEMO_EXAMPLE, EXAMPLES_DIR, example_names
    from kvtiers.engine.demo import DEFAULT_OUT, MARKER

    parser.description = (
        "Run a simulated engine over a tier stack twice: cold, then after a restart with "
        "the persistent tiers' indexes rebuilt. Every loaded byte is verified; the last "
        "line is the verdict (exit 1 if any byte was wrong). The demo writes only under "
        f"--out and the file tiers' roots, marks each directory it creates with {MARKER}, "
        "and refuses a non-empty directory it did not create."
    )
    parser.add_argument(
        "--config", default=DEMO_EXAMPLE, metavar="NAME|FILE",
        help=f"a shipped example by name ({', '.join(example_names())}; run at demo scale, "
             f"in {EXAMPLES_DIR}) or a stack file; without a model: section the demo's "
             f"model is used (default: {DEMO_EXAMPLE})")
    parser.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                        help="output directory: the plot, and the file tiers of a named "
                             f"example (default: ./{DEFAULT_OUT})")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="where to draw recomputed vs loaded tokens per tier over time "
                             "(default: DIR/demo.png)")
    parser.add_argument("--no-plot", action="store_true",
                        help="draw no plot (matplotlib is then not needed)")
    parser.add_argument("--conversations", type=int, default=16, metavar="N",
                        help="conversations in the workload (default: 16)")
    parser.add_argument("--turns", type=int, default=3, metavar="N",
                        help="turns per conversation; each turn's prompt extends the last "
                             "(default: 3)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the namespaces earlier runs left in the demo's roots, so "
                             "phase 1 is warm too")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (one is drawn only when stderr is a terminal)")


def _run_demo(args: argparse.Namespace) -> int:
    """Both demo phases; exit 1 if any loaded byte was wrong."""
    from pathlib import Path

    from kvtiers.engine.demo import run_demo
    from kvtiers.engine.workload import WorkloadSpec

    if args.conversations < 1 or args.turns < 1:
        raise ConfigError("--conversations and --turns must be at least 1")
    out_dir = Path(args.out)
    plot = None if args.no_plot else Path(args.plot) if args.plot else out_dir / "demo.png"
    run_demo(
        args.config,
        out_dir=out_dir,
        workload=WorkloadSpec(conversations=args.conversations, turns=args.turns),
        plot=plot,
        fresh=not args.keep,
        show_progress=not args.no_progress,
    )
    return EXIT_OK


def _add_location(parser: argparse.ArgumentParser, *, optional: bool = False) -> None:
    parser.add_argument("location", metavar="ROOT|s3://BUCKET/PREFIX|URL",
                        nargs="?" if optional else None,
                        help="a file tier's root directory, an S3 bucket and prefix, or an "
                        "fsspec URL (memory://kv, gcs://bucket/kv)"
                        + ("; optional with --shm" if optional else ""))
    parser.add_argument("--endpoint-url", metavar="URL",
                        help="S3 endpoint (default: AWS, or $AWS_ENDPOINT_URL)")
    parser.add_argument("--region", metavar="NAME", help="S3 region")


def _configure_inspect(parser: argparse.ArgumentParser) -> None:
    _add_location(parser)
    _add_json(parser)
    parser.add_argument("--tenant", action="append", default=[], metavar="NAME",
                        help="count this tenant's chunks and bytes (a name from the stack "
                             "file's tenants: section; repeatable)")


def _configure_verify(parser: argparse.ArgumentParser) -> None:
    _add_location(parser)
    _add_json(parser)
    parser.add_argument("--fix", action="store_true",
                        help="move corrupt chunks to <namespace>/quarantine/")


def _configure_gc(parser: argparse.ArgumentParser) -> None:
    _add_location(parser, optional=True)
    parser.add_argument("--shm", action="store_true",
                        help="also remove the cpu regions vLLM engines of this user left in "
                             "/dev/shm (kvtiers-<uid>-*) that no process maps (a killed "
                             "engine's); regions in use are kept")
    parser.add_argument("--namespace", action="append", default=[], metavar="NAME",
                        help="remove this whole namespace (repeatable)")
    parser.add_argument("--stale-days", type=float, metavar="D",
                        help="remove namespaces whose newest chunk is older than D days")
    parser.add_argument("--older-than-days", type=float, metavar="D",
                        help="remove chunks older than D days")
    parser.add_argument("--max-bytes", metavar="SIZE",
                        help="per namespace, remove the oldest chunks beyond SIZE (e.g. 50GiB)")
    parser.add_argument("--expired", action="append", default=[], metavar="LEDGER",
                        help="remove chunks past the TTL a retention ledger gives them "
                             "(the file an engine's retention.ledger names; repeatable: a "
                             "chunk goes when the latest expiry any ledger gives it passed)")
    parser.add_argument("--quarantine-older-than-days", type=float, metavar="D",
                        help="remove quarantined (corrupt) chunks set aside more than D "
                             "days ago (kvtiers inspect counts them)")
    parser.add_argument("--temp-age-s", type=float, default=3600.0, metavar="S",
                        help="remove interrupted temp files older than S seconds (default 3600)")
    parser.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")


@contextmanager
def _opened(args: argparse.Namespace) -> Iterator[Any]:
    """The location the arguments name (``_add_location``'s), closed when the block ends."""
    from kvtiers.tools.locations import open_location

    location = open_location(args.location, endpoint_url=args.endpoint_url, region=args.region)
    try:
        yield location
    finally:
        location.close()


def _on_location(
    run: Callable[[Any, argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """A command's body that works on one location: ``run(location, args)`` over
    :func:`_opened`'s."""

    def opened(args: argparse.Namespace) -> int:
        with _opened(args) as location:
            return run(location, args)

    return opened


@_on_location
def _run_inspect(location: Any, args: argparse.Namespace) -> int:
    from kvtiers.tools.commands import inspect

    return inspect(location, sys.stdout, as_json=args.json, tenants=args.tenant)


@_on_location
def _run_verify(location: Any, args: argparse.Namespace) -> int:
    from kvtiers.tools.commands import verify

    return verify(location, sys.stdout, fix=args.fix, as_json=args.json,
                  progress=not args.json and sys.stderr.isatty())


def _run_gc(args: argparse.Namespace) -> int:
    from kvtiers.config.sizes import parse_size
    from kvtiers.tools.commands import GcRules, gc

    for flag in ("stale_days", "older_than_days", "temp_age_s", "quarantine_older_than_days"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must not be negative, got {value}")
    expired = None
    if args.expired:
        from kvtiers.stack.ledger import read_ledgers

        expired = read_ledgers(args.expired)
    rules = GcRules(
        namespaces=tuple(args.namespace),
        expired=expired,
        stale_days=args.stale_days,
        older_than_days=args.older_than_days,
        max_bytes=None if args.max_bytes is None else parse_size(args.max_bytes,
                                                                  path="--max-bytes"),
        temp_age_s=args.temp_age_s,
        dry_run=args.dry_run,
        quarantine_older_than_days=args.quarantine_older_than_days,
    )
    if args.location is None:
        if not args.shm:
            raise ConfigError("give a location (a file root, s3://bucket/prefix or a URL), "
                              "--shm, or both; see kvtiers gc --help")
        if rules.namespaces or rules.stale_days is not None or (
                rules.older_than_days is not None or rules.max_bytes is not None
                or rules.quarantine_older_than_days is not None or rules.expired is not None):
            raise ConfigError("--namespace, --stale-days, --older-than-days, --max-bytes, "
                              "--expired and --quarantine-older-than-days choose what goes "
                              "from a location: give one")
    status = EXIT_OK
    if args.location is not None:
        with _opened(args) as location:
            status = gc(location, rules, sys.stdout)
    if args.shm:
        from kvtiers.tools.commands import gc_shm

        gc_shm(sys.stdout, dry_run=args.dry_run)
    return status


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="a stack file whose cpu tier sizes and names the pool")
    parser.add_argument("--socket", metavar="PATH", help="the Unix socket to listen on "
                        "(default: $XDG_RUNTIME_DIR/kvtiers/serve.sock)")
    parser.add_argument("--slot-bytes", type=int, metavar="N",
                        help="slot size when the stack file has no model: section")
    parser.add_argument("--group", metavar="NAME",
                        help="admit engines of this group too (socket and pool 0660)")
    parser.add_argument("--fresh", action="store_true",
                        help="start with an empty pool instead of re-adopting the last one")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="export Prometheus metrics on this port (the metrics extra)")
    parser.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                        help="address of the metrics exporter (default 127.0.0.1)")


def _run_serve(args: argparse.Namespace) -> int:
    """Run the node's pool service until SIGTERM (docs/service.md)."""
    from pathlib import Path

    from kvtiers.service.main import serve

    return serve(args.config, socket_path=Path(args.socket) if args.socket else None,
                 slot_bytes=args.slot_bytes, group=args.group, fresh=args.fresh,
                 metrics_port=args.metrics_port, metrics_addr=args.metrics_addr)


def _configure_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", metavar="PATH", help="the service's socket "
                        "(default: $XDG_RUNTIME_DIR/kvtiers/serve.sock)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def _run_status(args: argparse.Namespace) -> int:
    """Print the service's engines, pool occupancy and namespaces; 1 if it is down."""
    from pathlib import Path

    from kvtiers.service.client import ServiceDown, read_status
    from kvtiers.service.main import default_socket, print_status

    path = Path(args.socket) if args.socket else default_socket()
    try:
        state = read_status(path)
    except (OSError, ServiceDown) as exc:
        print(f"kvtiers: no service answers on {path}: {_one_line(str(exc))}",
              file=sys.stderr)
        return EXIT_FAILURE
    print_status(state, as_json=args.json)
    return 0


def _configure_identity(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Print the cache identity (every field, the digest and the namespace) that a "
        "stack file's model: section gives, or with --vllm the one `vllm serve` would use "
        "for the arguments after --vllm (read through vLLM's own configuration classes, "
        "on this machine's platform; --kv-transfer-config as `kvtiers vllm-config` prints "
        "it, or give the stack FILE and it is added)."
    )
    parser.add_argument("config", metavar="FILE", nargs="?",
                        help="a stack file (with a model: section unless --vllm is given)")
    _add_json(parser, "print one JSON document (namespace, digest, identity)")
    parser.add_argument("--vllm", nargs=argparse.REMAINDER, metavar="ARG",
                        help="the arguments of `vllm serve` (model first), to the end of "
                             "the line")


def _vllm_arguments(args: argparse.Namespace) -> list[str]:
    """``--vllm``'s arguments, with the stack FILE's ``--kv-transfer-config`` added when a
    FILE is given (giving both is a usage error)."""
    argv = list(args.vllm)
    given = any(arg == "--kv-transfer-config" or arg.startswith("--kv-transfer-config=")
                for arg in argv)
    if args.config is None:
        return argv
    if given:
        raise ConfigError(f"{args.config}: give the stack FILE or --kv-transfer-config "
                          "among the vLLM arguments, not both")
    from kvtiers.tools.vllm_config import transfer_config_json

    return [*argv, "--kv-transfer-config", transfer_config_json(args.config)]


def _run_identity(args: argparse.Namespace) -> int:
    """Print the identity (fields, digest, namespace) a stack file's model gives, or
    vLLM's arguments give (``--vllm``)."""
    from kvtiers.filemapper import NamespaceIdentity
    from kvtiers.tools.identity import print_identity

    if args.vllm is not None:
        if not args.vllm:
            raise ConfigError("--vllm needs the arguments of `vllm serve`, model first")
        if not _vllm_present():
            raise ConfigError("--vllm reads vLLM's configuration classes: install vLLM "
                              "(pip install 'kvtiers[vllm]') where the server runs")
        # vLLM logs to stdout unless told otherwise; the report (and --json) owns stdout.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from kvtiers.integrations.vllm.offline import identity_from_args

        offloading = identity_from_args(_vllm_arguments(args))
    else:
        from kvtiers.config import load_stack_config
        from kvtiers.config.examples import example_path

        if args.config is None:
            raise ConfigError("give a stack FILE with a model: section, or --vllm and the "
                              "arguments of `vllm serve`")
        stack = load_stack_config(example_path(str(args.config)) or args.config)
        if stack.model is None:
            raise ConfigError(
                f"{args.config}: no model: section, so no cache identity to show; add one "
                "(see kvtiers/configs/demo.yaml, run `kvtiers identity demo`, or give the "
                "server's arguments: `kvtiers identity FILE --vllm MODEL ...`)"
            )
        offloading = stack.model.to_offloading_config()
    identity = NamespaceIdentity.from_config(offloading)
    if args.json:
        import json

        json.dump({"namespace": identity.namespace, "digest": identity.hexdigest,
                   "identity": identity.to_dict()}, sys.stdout, indent=2, ensure_ascii=False)
        print()
    else:
        print_identity(identity, sys.stdout)
    return EXIT_OK


def _vllm_present() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _configure_diff(parser: argparse.ArgumentParser) -> None:
    _add_location(parser)
    parser.add_argument("first", metavar="NS_A", help="a namespace (kvtiers inspect lists them)")
    parser.add_argument("second", metavar="NS_B", help="the namespace to compare it with")
    _add_json(parser)
    parser.description = ("Name every identity field that differs between two namespaces' "
                          "manifests. Exit status 0 when the identities are identical, 1 "
                          "when they differ (or a namespace cannot be read).")


@_on_location
def _run_diff(location: Any, args: argparse.Namespace) -> int:
    from kvtiers.tools.identity import diff

    return diff(location, args.first, args.second, sys.stdout, as_json=args.json)


def _configure_has(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Ask a namespace's summary (a Bloom filter of its chunk keys, which a shared tier "
        "with list_interval_s and summary_interval_s keeps beside the manifest) whether "
        "the store holds chunks, without listing it. Exit status 0 when every key is "
        "present, 1 when one is absent, 3 when there is no summary to ask (none, or one "
        "that cannot be read), 2 for a key that cannot be one of the namespace's. A "
        "present answer "
        "is wrong for about 0.82% of keys never stored; an absent one is never wrong for a "
        "chunk that was there when the summary was made."
    )
    _add_location(parser)
    parser.add_argument("namespace", metavar="NAMESPACE",
                        help="the namespace (kvtiers inspect lists them)")
    parser.add_argument("keys", nargs="+", metavar="KEY",
                        help="chunk keys, a prefix's in token order: each chunk's file name "
                        "(<hash hex>_g<group>) or the key's bytes in hex")
    _add_json(parser)


@_on_location
def _run_has(location: Any, args: argparse.Namespace) -> int:
    from kvtiers.tools.summary import has

    return has(location, args.namespace, args.keys, sys.stdout, as_json=args.json)


def _configure_vllm_config(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Print the --kv-transfer-config argument that turns the stack in FILE on in vLLM "
        "(route 1 through KVTiersConnector), quoted for a POSIX shell: paste it after "
        "vllm serve MODEL. The stack file is validated first; its path is made absolute, "
        "since vLLM's processes may run elsewhere."
    )
    parser.add_argument("config", metavar="FILE", help="the stack file")
    _add_json(parser, "print only the JSON value, unquoted")


def _run_vllm_config(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from kvtiers.config import load_stack_config
    from kvtiers.tools.vllm_config import transfer_config_json

    load_stack_config(args.config)
    value = transfer_config_json(Path(args.config).absolute())
    print(value if args.json else f"--kv-transfer-config {shlex.quote(value)}")
    return EXIT_OK


COMMANDS: tuple[Command, ...] = (
    Command(
        name="check",
        help="run every start-time check of stack files (credentials, buckets, roots, "
             "space, ports) without starting anything",
        configure=_configure_check,
        run=_run_check,
    ),
    Command(
        name="demo",
        help="run a simulated engine over a tier stack, then restart it and hit warm",
        configure=_configure_demo,
        run=_run_demo,
    ),
    Command(
        name="inspect",
        help="list namespaces with their manifest fields, chunk counts, bytes and age",
        configure=_configure_inspect,
        run=_run_inspect,
    ),
    Command(
        name="verify",
        help="check every chunk's header and checksum; --fix quarantines bad ones",
        configure=_configure_verify,
        run=_run_verify,
    ),
    Command(
        name="gc",
        help="remove stale namespaces, old chunks, chunks beyond a size, and temp files; "
             "--shm: cpu regions killed engines left",
        configure=_configure_gc,
        run=_run_gc,
    ),
    Command(
        name="serve",
        help="run the node's shared KV pool that engines with a service tier attach to",
        configure=_configure_serve,
        run=_run_serve,
    ),
    Command(
        name="status",
        help="show a running kvtiers serve: engines, pool occupancy, namespaces",
        configure=_configure_status,
        run=_run_status,
    ),
    Command(
        name="identity",
        help="print the cache identity and namespace a stack file's model: section (or "
             "vLLM's serve arguments) gives",
        configure=_configure_identity,
        run=_run_identity,
    ),
    Command(
        name="diff",
        help="name the identity fields that differ between two namespaces (why a cache missed)",
        configure=_configure_diff,
        run=_run_diff,
    ),
    Command(
        name="has",
        help="ask a namespace's summary whether the store holds a prefix's chunks",
        configure=_configure_has,
        run=_run_has,
    ),
    Command(
        name="vllm-config",
        help="print the --kv-transfer-config that turns a stack file on in vLLM",
        configure=_configure_vllm_config,
        run=_run_vllm_config,
    ),
    Command(
        name="validate",
        help="check tier stack files and print a summary of each",
        configure=_configure_validate,
        run=_run_validate,
    ),
)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error reported on one line (status 2) like every other."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command in :data:`COMMANDS`."""
    parser = _Parser(
        prog="kvtiers", description="Tiered KV-cache storage for LLM serving engines."
    )
    parser.add_argument("--version", action="version", version=f"kvtiers {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.run(args)
    except ConfigError as exc:
        print(f"kvtiers: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KVTiersError as exc:
        print(f"kvtiers: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:  # before OSError, of which it is one
        _quiet_closed_pipe()
        return EXIT_PIPE
    except (OSError, MemoryError, OverflowError) as exc:
        # The system refused (permissions, a full disk, memory a stack asked for): say
        # what, in one line, rather than a traceback.
        print(f"kvtiers: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except ModuleNotFoundError as exc:
        # An optional package a command needs is missing: name the extra that has it.
        from kvtiers.optional import hint_for

        print(f"kvtiers: {hint_for(exc.name or str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("kvtiers: interrupted", file=sys.stderr)
        return 130
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_closed_pipe()
        return EXIT_PIPE
    return status


def _quiet_closed_pipe() -> None:
    """The reader of stdout went away (``kvtiers inspect | head``): point stdout at
    /dev/null so the interpreter's final flush does not report the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    raise SystemExit(main())
