"""`blazar`: the daemon (`serve`) and kubectl-like commands that talk to it over gRPC.

Every command finds the daemon at --server (HOST:PORT, or unix:PATH), else on the
Control socket of $BLAZAR_HOME (`control.sock`), which only the daemon's owner can
use. Over TCP, Control needs an admin key: --api-key, else $BLAZAR_API_KEY, sent as
`authorization: Bearer <key>`. A daemon serving TLS (`serve --tls-cert`) is reached
over TCP with --tls-ca FILE, else $BLAZAR_TLS_CA: the PEM certificate authority that
signed its certificate. The Unix socket is always plain.
Errors from the server print as `Error from server (Reason): message` and exit 1. When
the reader of stdout goes away (`| head`), a command ends quietly with 141.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import grpc

from blazar import eventloop, logs
from blazar._proto.v1 import control_pb2
from blazar.api import errors, features, kinds, manifests, tenants
from blazar.cli import client, diffs, home, observe, printers
from blazar.controller import residency
from blazar.export import kubernetes
from blazar.rpc import status


def _read_docs(targets: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """The documents of every `-f` target, in order (kubectl takes `-f` repeated)."""
    if list(targets).count("-") > 1:
        raise errors.InvalidRequest("'-f -' (standard input) can be given only once")
    missing = [t for t in targets if t != "-" and not Path(t).exists()]
    if missing:
        raise errors.InvalidRequest(f"the path '{missing[0]}' does not exist")
    docs: list[tuple[str, dict[str, Any]]] = []
    for target in targets:
        if target == "-":
            docs += manifests.parse_documents(_stdin_text(), source="<stdin>")
        else:
            docs += manifests.load_path(Path(target))
    return docs


def _stdin_text() -> str:
    """Standard input as UTF-8, as files are read (`manifests.load_path`), whatever
    the locale's encoding: the same manifest piped in is the same manifest."""
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        problem = errors.FieldError("<stdin>", f"cannot read: {exc}")
        raise errors.ManifestInvalid([problem]) from None


def _no_objects(verb: str, targets: Sequence[str]) -> errors.InvalidRequest:
    """kubectl's error for `-f` files that hold only comments or empty documents, which
    would otherwise do nothing and exit 0 as if they had been applied."""
    shown = [("standard input" if t == "-" else f"'{t}'") for t in targets]
    holds = "holds" if len(shown) == 1 else "hold"
    return errors.InvalidRequest(
        f"no objects passed to {verb}: {', '.join(shown)} {holds} no objects"
    )


# How a daemon that does not read `ApplyRequest.sources` (an older one) locates a
# document: by its place in the batch, which runs on across every `-f` file.
_BATCH_PLACE = re.compile(r"\bobject#(\d+)\b")
# A line of a manifest error about an object, not yet located by document.
_OBJECT_ERROR = re.compile(
    rf"^((?:{'|'.join(kind.value for kind in kinds.Kind)})/[^\s:()]+): ", re.MULTILINE
)


class _FromServer(Exception):
    """An error the daemon sent, as the CLI rewrote it (`_apply`)."""

    def __init__(self, remote: errors.BlazarError) -> None:
        super().__init__(remote.message)
        self.remote = remote


def _apply(
    control: client.ControlClient,
    request: control_pb2.ApplyRequest,
    docs: Sequence[tuple[str, dict[str, Any]]],
) -> control_pb2.ApplyResponse:
    """`control.apply`; a manifest error naming documents by their place in the batch
    (`object#3`, counted over every file) names them by file instead (`fleet/b.yaml#1`),
    as `apply -f` read them."""
    preconditions, malformed = manifests.resource_versions(docs)
    if preconditions or malformed:
        control.require(features.APPLY_PRECONDITION, used="metadata.resourceVersion")
    try:
        return control.apply(request)
    except grpc.RpcError as exc:
        remote = status.from_rpc_error(exc)
        if isinstance(remote, errors.RequestTooLarge):
            raise _FromServer(_batch_too_large(remote)) from exc
        if not isinstance(remote, errors.ManifestInvalid):
            raise

        def where(match: re.Match[str]) -> str:
            n = int(match.group(1))
            return docs[n - 1][0] if 0 < n <= len(docs) else match.group(0)

        # An object's own errors (`Lane/x: spec.replicas`) say which file too, as the
        # watched directory's events do (`manifests.locate`): with many files given,
        # the name alone leaves the reader to search them.
        read_from = manifests.locations(docs)

        def located(match: re.Match[str]) -> str:
            found = read_from.get(match.group(1))
            return f"{match.group(1)} ({found}): " if found else match.group(0)

        message = _BATCH_PLACE.sub(where, remote.message)
        remote.message = _OBJECT_ERROR.sub(located, message)
        raise _FromServer(remote) from exc


def _batch_too_large(remote: errors.RequestTooLarge) -> errors.RequestTooLarge:
    """The daemon's refusal of a batch by its size, worded for manifests: its own
    wording asks for a shorter prompt, which an `apply` has none of."""
    size, limit = remote.metadata.get("request_bytes"), remote.metadata.get("limit_bytes")
    if limit is None or not limit.isdigit():
        return remote
    return status.request_too_large(
        int(size) if size is not None and size.isdigit() else None,
        limit=int(limit),
        what="batch of manifests",
        hint="Apply the files in smaller batches, or make the objects smaller.",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from blazar.cli import daemon  # the daemon's imports are heavy; only serve needs them

    if args.watch and not Path(args.watch).is_dir():
        # Before anything binds or starts: a daemon that cannot watch its fleet would
        # serve whatever the store last held.
        raise errors.InvalidRequest(f"--watch: '{args.watch}' is not a directory")
    # Read before logging is configured: a flag that does not read starts nothing.
    memory_budget = _size_flag("--memory-budget", args.memory_budget)
    min_residency_s = _duration_flag("--min-residency", args.min_residency)
    try:
        logs.level_number()
    except ValueError as exc:
        raise errors.InvalidRequest(f"BLAZAR_LOG_LEVEL: {exc}") from None
    logs.configure(json=None if not args.log_json else True)
    options = daemon.Options(
        home=Path(args.home).expanduser() if args.home else home.default_home(),
        http=args.http or os.environ.get("BLAZAR_HTTP_ADDR") or daemon.DEFAULT_HTTP,
        grpc=args.grpc or os.environ.get("BLAZAR_GRPC_ADDR") or daemon.DEFAULT_GRPC,
        watch=Path(args.watch) if args.watch else None,
        prune=args.prune,
        log_json=True,
        model_cache=daemon.default_model_cache(),
        model_roots=tuple(Path(d) for d in args.model_root),
        auth_file=Path(args.auth_file) if args.auth_file else None,
        allow_origins=tuple(args.allow_origin or ()),
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        memory_budget=memory_budget,
        min_residency_s=min_residency_s,
    )
    eventloop.run(daemon.run(options))
    return 0


def _size_flag(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    if value.strip().startswith("-"):
        raise errors.InvalidRequest(
            f"{flag}: the budget must be more than 0 bytes, and {value} is negative"
        )
    try:
        size = kinds.parse_size(value)
    except ValueError as exc:
        raise errors.InvalidRequest(f"{flag}: {exc}") from None
    if size <= 0:
        raise errors.InvalidRequest(f"{flag}: the budget must be more than 0 bytes")
    return size


def _duration_flag(flag: str, value: str | None) -> float | None:
    if value is None:
        return None
    if value.strip().startswith("-"):
        raise errors.InvalidRequest(
            f"{flag}: a duration cannot be negative ({value}); use 0s for none, or e.g. 30s"
        )
    try:
        return kinds.parse_duration(value).total_seconds()
    except ValueError as exc:
        raise errors.InvalidRequest(f"{flag}: {exc}") from None


def cmd_auth_key(args: argparse.Namespace) -> int:
    key = tenants.new_key()
    print(f"key:    {key}")
    print(f"digest: {tenants.digest(key)}")
    print("Give the key to its holder; put the digest in the tenant's `keys` in the auth file.",
          file=sys.stderr)  # fmt: skip
    return 0


def cmd_auth_hash(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().strip()
    if not key:
        raise errors.InvalidRequest("auth hash reads a key from standard input; none was given")
    print(tenants.digest(key))
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    docs = _read_docs(args.filename)
    if not docs:
        raise _no_objects("apply", args.filename)
    request = control_pb2.ApplyRequest(
        objects_json=[json.dumps(doc) for _, doc in docs],
        dry_run=args.dry_run,
        field_manager="blazar-cli",
        # So that the daemon's ManifestRejected event names the files too.
        sources=[location for location, _ in docs],
    )
    with client.from_args(args) as control:
        response = _apply(control, request, docs)
    suffix = " (dry run)" if args.dry_run else ""
    for result in response.results:
        print(f"{result.kind.lower()}/{result.name} {result.action}{suffix}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """What `apply` of the same files would change, as a unified diff of what users
    write; 0 when nothing, 1 when something would change (errors: 2), as kubectl."""
    docs = _read_docs(args.filename)
    if not docs:
        raise _no_objects("diff", args.filename)
    request = control_pb2.ApplyRequest(
        objects_json=[json.dumps(doc) for _, doc in docs],
        dry_run=True,
        field_manager="blazar-cli",
        sources=[location for location, _ in docs],
    )
    changed = False
    with client.from_args(args) as control:
        for result in _apply(control, request, docs).results:
            if result.action == "unchanged":
                continue
            live = None
            if result.action != "created":
                got = control.get(control_pb2.GetRequest(kind=result.kind, name=result.name))
                live = json.loads(got.object_json)
            applied = None if result.action == "pruned" else json.loads(result.object_json)
            text = diffs.unified(live, applied, label=f"{result.kind.lower()}/{result.name}")
            if text:
                changed = True
                sys.stdout.write(text)
    return 1 if changed else 0


def _split_kind_name(args: argparse.Namespace, verb: str) -> None:
    """`KIND/NAME` as the one argument (`get lane/gemma3`, as `get -o name` prints it
    and kubectl takes it) into `args.kind` and `args.name`; anything else as it is."""
    if not args.kind or "/" not in args.kind:
        return
    if args.name:
        # kubectl's rule: the kind is given once, in KIND/NAME or on its own.
        raise errors.InvalidRequest(
            f"{verb} takes KIND NAME or KIND/NAME, not both ('{args.kind}' and '{args.name}')"
        )
    args.kind, args.name = observe.object_ref(args.kind, flag=verb)


def _name_or_selector(args: argparse.Namespace, verb: str) -> None:
    """kubectl's rule: a NAME picks one object, a selector filters a list; given both,
    one of them would be ignored, so neither is guessed at. An empty NAME (`get lane
    ""`, a shell variable left unset) is refused as kubectl does, not read as none."""
    if args.name == "":
        raise errors.InvalidRequest(f"{verb}: a resource name may not be empty")
    if args.name and args.selector:
        raise errors.InvalidRequest(
            f"{verb} takes a NAME or -l SELECTOR, not both ('{args.name}' and '{args.selector}')"
        )


def _objects(
    control: client.ControlClient, args: argparse.Namespace
) -> tuple[str, list[printers.ObjectJson]]:
    kind = kinds.resolve_kind(args.kind)
    if args.name:
        got = control.get(control_pb2.GetRequest(kind=kind.value, name=args.name))
        return kind.value, [json.loads(got.object_json)]
    listed = control.list(
        control_pb2.ListRequest(kind=kind.value, label_selector=args.selector or "")
    )
    return kind.value, [json.loads(o) for o in listed.objects_json]


def cmd_get(args: argparse.Namespace) -> int:
    _split_kind_name(args, "get")
    _name_or_selector(args, "get")
    if args.watch:
        return observe.watch(args)
    with client.from_args(args) as control:
        kind, objs = _objects(control, args)
    if args.output == "json":
        print(printers.as_json(objs, named=bool(args.name)))
    elif args.output == "yaml":
        print(printers.as_yaml(objs, named=bool(args.name)))
    elif not objs:
        # On stderr, as kubectl: stdout holds only objects (an empty List for -o json
        # and -o yaml).
        print(_none_found(kind), file=sys.stderr)
    elif args.output == "name":
        # kubectl's `-o name`: kind/name a line, for scripts (`xargs blazar delete`).
        for obj in objs:
            print(f"{kind.lower()}/{obj['metadata']['name']}")
    else:
        print(printers.table(kind, objs, wide=args.output == "wide", now=datetime.now(UTC)))
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    _split_kind_name(args, "describe")
    _name_or_selector(args, "describe")
    pages = []
    with client.from_args(args) as control:
        kind, objs = _objects(control, args)
        for obj in objs:
            name = obj["metadata"]["name"]
            request = control_pb2.EventsRequest(kind=kind, name=name, limit=50)
            events = [observe.event_json(e) for e in control.events(request).events]
            pages.append(printers.describe(obj, events, now=datetime.now(UTC)))
    if not pages:
        print(_none_found(kind), file=sys.stderr)
        return 0
    print("\n\n".join(pages))
    return 0


def _none_found(kind: str) -> str:
    """What `get` and `describe` say, on stderr, when a selector matches nothing."""
    return f"No {kind} resources found."


def cmd_delete(args: argparse.Namespace) -> int:
    targets: list[tuple[str, str]]
    if args.filename:
        if args.kind or args.names:
            raise errors.InvalidRequest("delete takes KIND NAME... or -f FILE, not both")
        # Kind and name only: a file that no longer validates still deletes what it made.
        found = manifests.identities(_read_docs(args.filename))
        if not found:
            raise _no_objects("delete", args.filename)
        # Each once, as for names given on the command line.
        targets = list(dict.fromkeys((kind.value, name) for kind, name in found))
    elif args.kind and "/" in args.kind:
        # KIND/NAME..., as `get -o name` prints them.
        refs = [args.kind, *args.names]
        targets = list(dict.fromkeys(observe.object_ref(t, flag="delete") for t in refs))
    elif args.kind and args.names:
        kind = kinds.resolve_kind(args.kind).value
        targets = [(kind, name) for name in dict.fromkeys(args.names)]
    else:
        raise errors.InvalidRequest("delete needs KIND NAME..., KIND/NAME... or -f FILE")
    gone = 0
    with client.from_args(args) as control:
        for kind, name in targets:
            try:
                control.delete(control_pb2.DeleteRequest(kind=kind, name=name))
            except grpc.RpcError as exc:
                # As kubectl: an object already gone is reported and the others are
                # still deleted; stopping here would leave whatever follows it running.
                remote = status.from_rpc_error(exc)
                if len(targets) == 1 or not isinstance(remote, errors.ObjectNotFound):
                    raise
                print(_from_server(remote), file=sys.stderr)
                gone += 1
                continue
            print(f"{kind.lower()}/{name} deleted")
    return 1 if gone else 0


def cmd_export_kubernetes(args: argparse.Namespace) -> int:
    from blazar.cli import export  # reads GGUF headers; only export needs it

    return export.kubernetes_command(
        _read_docs(args.filename), fleet=args.fleet, image=args.image, output=args.output
    )


def _flag(text: str) -> bool:
    """A boolean flag's value as kubectl spells it (`--prune=false`)."""
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not '{text}'")


def _dry_run(text: str) -> bool:
    """`--dry-run`'s value as kubectl spells it: `server` and `client` both preview on
    the daemon (Blazar has no client-side check, and the daemon's is the stricter);
    `none` applies."""
    if text in ("server", "client"):
        return True
    if text == "none":
        return False
    raise argparse.ArgumentTypeError(f"expected none, client or server, not '{text}'")


FILENAME_HELP = "file, directory (read recursively, as kubectl -R), or - for stdin; repeatable"
SELECTOR_HELP = "label selector: k=v, k==v, k!=v, k, !k; comma-separated, all must hold"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blazar", description="Local LLM inference controller.")
    parser.add_argument(
        "--server",
        help="daemon gRPC address, HOST:PORT or unix:PATH (default: the Control socket in "
        "$BLAZAR_HOME)",
    )
    parser.add_argument(
        "--api-key", help="API key of an admin tenant, for Control over TCP ($BLAZAR_API_KEY)"
    )
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="PEM certificate authority of a daemon serving TLS, reached over TCP ($BLAZAR_TLS_CA)",
    )
    parser.add_argument(
        "--request-timeout",
        metavar="DURATION",
        help="give up on a call to the daemon after this long (5, 5s, 2m; default 0: wait); "
        "not on a watch or a followed log",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument(
        "--watch", metavar="DIR", help="apply every manifest under DIR, again on change"
    )
    serve.add_argument(
        "--prune",
        type=_flag,
        nargs="?",
        const=True,
        default=True,
        metavar="true|false",
        help="delete what --watch applied once no file holds it (default true)",
    )
    serve.add_argument(
        "--http", help="HTTP shim address (default $BLAZAR_HTTP_ADDR or 127.0.0.1:8420)"
    )
    serve.add_argument("--grpc", help="gRPC address (default $BLAZAR_GRPC_ADDR or 127.0.0.1:8421)")
    serve.add_argument(
        "--home",
        help=(
            "state directory (default $BLAZAR_HOME, else $XDG_DATA_HOME/blazar, "
            "else ~/.local/share/blazar)"
        ),
    )
    serve.add_argument("--log-json", action="store_true", help="JSON logs even on a terminal")
    serve.add_argument(
        "--model-root",
        metavar="DIR",
        action="append",
        default=[],
        help="a directory whose GGUF files Models may name with source.path (repeatable; "
        "$BLAZAR_HOME/models always, and $BLAZAR_MODEL_ROOTS)",
    )
    serve.add_argument(
        "--auth-file",
        metavar="FILE",
        help="tenants and their API keys (YAML; docs/SECURITY.md); read again on change",
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        metavar="ORIGIN",
        help="a web origin (https://app.example) whose pages may call the HTTP API; repeatable",
    )
    serve.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="PEM certificate chain: HTTPS and gRPC over TLS on the TCP addresses (with --tls-key)",
    )
    serve.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="memory all engines together may hold (bytes, or Ki/Mi/Gi/Ti: 8Gi); a request "
        "for a Lane that does not fit puts idle Lanes to sleep (default: what the host has)",
    )
    serve.add_argument(
        "--min-residency",
        metavar="DURATION",
        help="how long a Lane stays loaded before the budget may put it to sleep for "
        f"another (default {residency.DEFAULT_MIN_RESIDENCY_S:g}s)",
    )
    serve.set_defaults(func=cmd_serve)

    auth = sub.add_parser("auth", help="API keys for the auth file")
    auth_sub = auth.add_subparsers(dest="auth_command", required=True)
    auth_sub.add_parser("key", help="print a new random key and its digest").set_defaults(
        func=cmd_auth_key
    )
    auth_sub.add_parser("hash", help="print the digest of a key read from stdin").set_defaults(
        func=cmd_auth_hash
    )

    apply = sub.add_parser("apply", help="create or update objects from manifests")
    apply.add_argument("-f", "--filename", required=True, action="append", help=FILENAME_HELP)
    apply.add_argument(
        "--dry-run",
        type=_dry_run,
        nargs="?",
        const=True,
        default=False,
        metavar="server|client|none",
        help="validate on the daemon and report, change nothing (server and client "
        "alike; none: apply)",
    )
    apply.set_defaults(func=cmd_apply)

    diff = sub.add_parser(
        "diff",
        help="show what apply would change (exit 0: nothing, 1: changes, 2: error)",
        description="Show what apply would change, as a unified diff of the live objects "
        "and the manifests. Exit status 0: nothing would change, 1: something would, "
        "2: an error (as kubectl diff).",
    )
    diff.add_argument("-f", "--filename", required=True, action="append", help=FILENAME_HELP)
    diff.set_defaults(func=cmd_diff, error_status=2)

    get = sub.add_parser("get", help="list objects of a kind")
    get.add_argument("kind")
    get.add_argument("name", nargs="?")
    get.add_argument("-o", "--output", choices=["yaml", "json", "wide", "name"])
    get.add_argument("-l", "--selector", help=SELECTOR_HELP)
    get.add_argument(
        "-w", "--watch", action="store_true", help="after the list, a line per change (Ctrl-C ends)"
    )
    get.set_defaults(func=cmd_get)

    describe = sub.add_parser("describe", help="show an object with its conditions and events")
    describe.add_argument("kind")
    describe.add_argument("name", nargs="?")
    describe.add_argument("-l", "--selector", help=SELECTOR_HELP)
    describe.set_defaults(func=cmd_describe)

    delete = sub.add_parser("delete", help="delete objects")
    delete.add_argument("kind", nargs="?")
    delete.add_argument("names", nargs="*", metavar="NAME")
    delete.add_argument("-f", "--filename", action="append", help=FILENAME_HELP)
    delete.set_defaults(func=cmd_delete)

    export = sub.add_parser("export", help="write the fleet's manifests for another platform")
    targets = export.add_subparsers(dest="export_target", required=True)
    k8s = targets.add_parser(
        "kubernetes",
        help="Deployments and Services running llama-server, InferencePools and "
        "InferenceObjectives, and a ConfigMap of the fleet, as YAML",
    )
    k8s.add_argument("-f", "--filename", required=True, action="append", help=FILENAME_HELP)
    k8s.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write the YAML to FILE, not stdout (a file name, not a format: always YAML)",
    )
    k8s.add_argument(
        "--image", default=kubernetes.IMAGE, help=f"llama-server's image ({kubernetes.IMAGE})"
    )
    k8s.add_argument(
        "--fleet",
        default=kubernetes.DEFAULT_FLEET,
        help="prefix of the fleet-wide objects' names, value of their part-of label "
        f"({kubernetes.DEFAULT_FLEET})",
    )
    k8s.set_defaults(func=cmd_export_kubernetes)

    observe.add_commands(sub)
    return parser


# Flags whose value a user may write with a minus sign. argparse reads "-1s" after one
# as an option of its own and says only "expected one argument"; attached to its flag,
# the value reaches the flag's own check, which says what is wrong with it.
_SIGNED_VALUE_FLAGS = frozenset({"--min-residency", "--memory-budget"})
# A minus and a digit: no option of blazar's starts so.
_SIGNED = re.compile(r"-[\d.]")


def attach_signed_values(argv: Sequence[str]) -> list[str]:
    """`argv` with each value of `_SIGNED_VALUE_FLAGS` that starts with a minus sign
    attached to its flag (`--min-residency=-1s`); all else (and all after `--`) as is."""
    out: list[str] = []
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg == "--":
            return [*out, arg, *rest]
        if arg in _SIGNED_VALUE_FLAGS and rest and _SIGNED.match(rest[0]):
            arg = f"{arg}={rest.pop(0)}"
        out.append(arg)
    return out


# The flags that say how to reach a running daemon, by their argparse names.
_DAEMON_FLAGS = {
    "server": "--server",
    "api_key": "--api-key",
    "tls_ca": "--tls-ca",
    "request_timeout": "--request-timeout",
}


def _unused_daemon_flags(args: argparse.Namespace) -> list[str]:
    """The daemon flags given to a command that calls no daemon (it runs one, or works
    on files alone): taken and ignored, they would mislead."""
    local = (cmd_serve, cmd_auth_key, cmd_auth_hash, cmd_export_kubernetes)
    if args.func not in local:
        return []
    return [flag for name, flag in _DAEMON_FLAGS.items() if getattr(args, name, None)]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(attach_signed_values(sys.argv[1:] if argv is None else argv))
    if unused := _unused_daemon_flags(args):
        print(
            f"error: {', '.join(unused)}: for commands that call a running daemon; "
            f"`blazar {args.command}` calls none",
            file=sys.stderr,
        )
        return 2
    if args.func is cmd_serve:
        # The daemon: a broken pipe there is a socket's, not its reader going away.
        return _run(args)
    try:
        try:
            return _run(args)
        finally:
            # Here, not at interpreter exit: output that fits the buffer is written
            # only then, and a closed pipe would surface as an unhandled error.
            sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """The reader of stdout went away (`blazar describe lane x | head`): end quietly, as
    kubectl and other Unix tools do, with the status a shell shows for them (killed by
    SIGPIPE: 128 + 13), so `set -o pipefail` scripts still see that output was lost."""
    # What is left in the buffer would fail again, noisily, when Python exits.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _run(args: argparse.Namespace) -> int:
    # What an error ends with: 1, except where 1 means something else (`diff`: changes).
    failed = int(getattr(args, "error_status", 1))
    try:
        return int(args.func(args))
    except errors.BlazarError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return failed
    except _FromServer as err:
        print(_from_server(err.remote), file=sys.stderr)
        return failed
    except grpc.RpcError as exc:
        remote = status.from_rpc_error(exc)
        timeout = client.request_timeout(args)
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
            print(
                f"error: the Blazar daemon at {client.target(args)} did not answer within "
                f"{timeout:g}s (--request-timeout)",
                file=sys.stderr,
            )
            return failed
        # Only when gRPC itself lost the daemon: an Unavailable the daemon sent (its
        # store cannot be written, say) is its answer, shown as any other.
        if status.lost_peer(exc):
            target = client.target(args)
            socket_path = Path(target.removeprefix("unix:"))
            if target.startswith("unix:") and _absent(socket_path):
                # gRPC says only "connect failed ... No such file or directory": the
                # usual cause is no daemon at all, or one started with another home.
                print(
                    f"error: cannot reach the Blazar daemon at {target}: no daemon serves "
                    f"the home {socket_path.parent} (it has no {socket_path.name}). Start "
                    "one (`blazar serve`), or give the home the running one was started "
                    "with (BLAZAR_HOME), or its address (--server).",
                    file=sys.stderr,
                )
                return failed
            # Nothing listens there: whether it would speak TLS is beside the point.
            refused = "Connection refused" in remote.message
            plain = (
                not target.startswith("unix:")
                and not (args.tls_ca or os.environ.get("BLAZAR_TLS_CA"))
                and not refused
            )
            hint = " (a daemon serving TLS needs --tls-ca FILE)" if plain else ""
            print(
                f"error: cannot reach the Blazar daemon at {target}: {remote.message}{hint}",
                file=sys.stderr,
            )
        else:
            print(_from_server(remote), file=sys.stderr)
            if (
                isinstance(remote, errors.Unauthenticated)
                and remote.metadata.get("credential") == "missing"
            ):
                # The server's message names HTTP headers and gRPC metadata; this
                # command line sends its key from a flag or the environment.
                print("(send one with --api-key KEY, or set BLAZAR_API_KEY)", file=sys.stderr)
        return failed
    except UnicodeEncodeError as exc:
        # An argument that is not UTF-8 (`get lane $'\xff'`): Python keeps its bytes as
        # lone surrogates, which fail only when a request is encoded. A path that is not
        # UTF-8 still works wherever it is used as a path.
        shown = repr(str(exc.object).encode("utf-8", "surrogateescape"))
        print(f"error: {shown} is not UTF-8 text", file=sys.stderr)
        return failed
    except KeyboardInterrupt:
        if args.func is not cmd_serve:
            _exit_interrupted()
        return 130


def _exit_interrupted() -> NoReturn:
    """Ctrl-C of a command: end now, with the status a shell shows for it, as kubectl
    does. Left to the interpreter's teardown, grpcio's channel finalizers run, and one
    whose call the interrupt landed in waits on a lock for good
    (`_ChannelCallState.__del__` -> `channel.close()`: 1 of 14 interrupted `logs -f`
    hung, one for over ten minutes). What was printed is flushed first."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(130)


def _absent(path: Path) -> bool:
    """Whether nothing is at `path`; not when it cannot be looked at (another user's
    0700 home: gRPC's "Permission denied" says that better)."""
    try:
        path.stat()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def _from_server(remote: errors.BlazarError) -> str:
    """An error the daemon sent, as kubectl shows one: `Error from server (Reason): ...`."""
    return f"Error from server ({_camel(remote.reason)}): {remote.message}"


def _camel(reason: str) -> str:
    return "".join(part.capitalize() for part in reason.split("_"))


if __name__ == "__main__":
    sys.exit(main())
