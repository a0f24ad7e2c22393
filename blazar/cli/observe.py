"""The commands that watch the fleet rather than change it: `get -w`, `logs`, `top`
and `events` (the parsers of the last three too). Each talks to the daemon through
`client.ControlClient`; errors are left for `blazar.cli.main` to print."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime

from blazar._proto.v1 import control_pb2
from blazar.api import errors, features, kinds, selectors, wire
from blazar.cli import client, printers


def watch(args: argparse.Namespace) -> int:
    """`get KIND -w`: the table (each object ADDED), then a line per change until
    Ctrl-C (or the daemon goes away), aligned with it. Changes that the table already
    shows are not repeated: a change is an object written after the list's
    resourceVersion, or a deletion."""
    if args.output in ("yaml", "json", "name"):
        raise errors.InvalidRequest(
            f"get -w prints a table; -o {args.output} is not watched (leave out -o, or use -o wide)"
        )
    kind = kinds.resolve_kind(args.kind)
    selector = selectors.parse(args.selector or "")
    wide = args.output == "wide"
    with client.from_args(args) as control:
        listed = control.list(
            control_pb2.ListRequest(kind=kind.value, label_selector=args.selector or "")
        )
        objs = [json.loads(o) for o in listed.objects_json]
        objs = [o for o in objs if not args.name or o["metadata"]["name"] == args.name]
        if args.name and not objs:
            # As `get NAME` and kubectl: a name that is not stored is NotFound, not a
            # watch that waits, silently, on a typo.
            control.get(control_pb2.GetRequest(kind=kind.value, name=args.name))
        rows = printers.WatchTable(kind.value, wide=wide)
        if objs:
            listed_rows = rows.lines([("ADDED", o) for o in objs], now=datetime.now(UTC))
            print("\n".join(listed_rows), flush=True)
        else:
            print(f"No {kind.value} resources found.", file=sys.stderr, flush=True)
        for event in control.watch(control_pb2.WatchRequest(kind=kind.value)):
            obj = json.loads(event.object_json)
            meta = obj["metadata"]
            if args.name and meta["name"] != args.name:
                continue
            if not selector.matches(meta.get("labels", {})):
                continue
            fresh = (
                event.type == "DELETED" or meta.get("resourceVersion", 0) > listed.resource_version
            )
            if fresh:
                changed = rows.lines([(event.type, obj)], now=datetime.now(UTC))
                print("\n".join(changed), flush=True)
    return 0


def event_json(e: control_pb2.Event) -> printers.EventJson:
    return {"time": e.time, "type": e.type, "reason": e.reason, "kind": e.kind, "name": e.name,
            "message": e.message, "uid": e.uid}  # fmt: skip


def object_ref(
    target: str, *, flag: str = "--for", kind_of: Callable[[str], str] | None = None
) -> tuple[str, str]:
    """A KIND/NAME argument's object (`events --for`, `logs`, `delete`), its kind in any
    accepted spelling (`kind_of` reads it, if given: `events` takes more kinds than
    objects have); `flag` names the argument in the error."""
    kind, sep, name = target.partition("/")
    if not sep or not kind or not name or "/" in name:
        raise errors.InvalidRequest(f"{flag} takes KIND/NAME (such as lane/gemma3), not '{target}'")
    return (kind_of(kind) if kind_of is not None else kinds.resolve_kind(kind).value), name


def cmd_logs(args: argparse.Namespace) -> int:
    """`logs lane/NAME [--replica N] [-f] [--tail N]`: the engine's output, through Control (the
    daemon may be on another host)."""
    kind, name = object_ref(args.target, flag="logs")
    if kind != kinds.Kind.LANE.value:
        raise errors.InvalidRequest(f"logs are kept for Lanes' engines, not for {kind}s")
    request = control_pb2.LogsRequest(lane=name, replica=args.replica, follow=args.follow)
    if args.tail >= 0:
        request.tail_lines = args.tail
    out = sys.stdout.buffer
    with client.from_args(args) as control:
        if request.HasField("tail_lines"):
            control.require(features.LOGS_TAIL, used="--tail")
        for data in control.logs(request):
            out.write(data)
            out.flush()
    return 0


def cmd_version(args: argparse.Namespace) -> int:
    """`version [--client]`: as kubectl prints it, this CLI's version first (also when
    the daemon cannot be reached), then the daemon's and what it acts on of the
    features added since the first release (`blazar.api.features`)."""
    print(f"Client Version: {features.version()}", flush=True)
    if args.client:
        return 0
    with client.from_args(args) as control:
        answer = control.version()
    if answer is None:
        print("Server Version: older than this CLI (it cannot tell its version)")
        missing = features.SERVED
    else:
        print(f"Server Version: {answer.version}")
        missing = tuple(f for f in features.SERVED if f not in answer.features)
    if missing:
        print(
            f"The daemon does not act on: {', '.join(missing)}; this CLI refuses to send "
            "them to it. Restart the daemon to run this version."
        )
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    with client.from_args(args) as control:
        response = control.top(control_pb2.TopRequest())
    rows = [
        printers.LaneLoad(
            lane=r.lane,
            replicas_reporting=r.replicas_reporting,
            slots_busy=r.slots_busy,
            slots_total=r.slots_total,
            queued=r.queued,
            running=r.running,
            tokens_per_second=r.tokens_per_second,
            memory_bytes=r.memory_bytes,
        )
        for r in response.lanes
    ]
    if args.output == "json":
        print(printers.top_json(rows))
    elif not rows:
        # On stderr, as `get` says it (and kubectl): stdout holds only the table.
        print(printers.top_table(rows), file=sys.stderr)
    else:
        print(printers.top_table(rows))
    return 0


# What the daemon records events for besides the kinds of objects (the OBJECT column
# of `events`): a rejected batch of manifests (`Manifest/<field manager or file>`),
# the auth file, and the store recovered at start.
EVENT_ONLY_KINDS = ("Manifest", "AuthFile", "Store")


def _event_kind(text: str) -> str:
    """A kind `events` filters by: an object's, in any accepted spelling, or one of
    `EVENT_ONLY_KINDS` (any case), so what the OBJECT column shows can be asked for."""
    try:
        return kinds.resolve_kind(text).value
    except errors.InvalidRequest as err:
        found = {k.lower(): k for k in EVENT_ONLY_KINDS}.get(text.strip().lower())
        if found is None:
            raise errors.InvalidRequest(
                f"{err.message}; events are also kept for {', '.join(EVENT_ONLY_KINDS)}",
                metadata=err.metadata,
            ) from None
        return found


def _whole_number(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `least` to the int32 its request field
    carries (larger, building the request raised a traceback)."""

    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not '{text}'") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
        if value > wire.INT32_MAX:
            raise argparse.ArgumentTypeError(f"must be at most {wire.INT32_MAX}, not {value}")
        return value

    return read


def cmd_events(args: argparse.Namespace) -> int:
    if args.kind and "/" in args.kind and not args.name and not args.for_:
        args.for_, args.kind = args.kind, None  # `events lane/gemma3`, as `get` takes it
    if args.for_ and (args.kind or args.name):
        raise errors.InvalidRequest("events takes KIND [NAME] or --for KIND/NAME, not both")
    if args.name == "" or args.kind == "":
        # A shell variable left unset: read as none, it would list every object's events.
        raise errors.InvalidRequest("events: a kind or resource name may not be empty")
    if args.for_:
        kind, name = object_ref(args.for_, kind_of=_event_kind)
    else:
        kind = _event_kind(args.kind) if args.kind else ""
        name = args.name or ""
    request = control_pb2.EventsRequest(kind=kind, name=name, limit=args.limit)
    with client.from_args(args) as control:
        response = control.events(request)
    events = [event_json(e) for e in response.events]
    if args.output == "json":
        print(json.dumps(events, indent=2))
    else:
        table = printers.events_table(events, now=datetime.now(UTC))
        # "No events." on stderr, as `get` says it has nothing: stdout holds only rows.
        print(table, file=sys.stdout if events else sys.stderr)
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `logs`, `version`, `top` and `events` to the CLI's subcommands."""
    logs = sub.add_parser("logs", help="a Lane replica's engine output")
    logs.add_argument("target", metavar="lane/NAME")
    logs.add_argument(
        "--replica", type=_whole_number(0), default=0, help="replica index (default 0)"
    )
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing what comes")
    logs.add_argument(
        "--tail",
        type=_whole_number(-1),
        default=-1,
        help="begin with the last N lines of the log (default -1: all of it)",
    )
    logs.set_defaults(func=cmd_logs)

    version = sub.add_parser(
        "version",
        help="this CLI's version and the daemon's, with the features the daemon acts on",
    )
    version.add_argument(
        "--client", action="store_true", help="this CLI's version only: call no daemon"
    )
    version.set_defaults(func=cmd_version)

    top = sub.add_parser(
        "top", help="each Lane's load: slots busy, queue, tokens/s, engines' memory"
    )
    top.add_argument("-o", "--output", choices=["json"])
    top.set_defaults(func=cmd_top)

    events = sub.add_parser("events", help="what the controller did, newest last")
    events.add_argument("kind", nargs="?")
    events.add_argument("name", nargs="?")
    events.add_argument(
        "--for", dest="for_", metavar="KIND/NAME", help="only this object's events (lane/gemma3)"
    )
    events.add_argument(
        "--limit",
        type=_whole_number(1),
        default=200,
        help="at most this many of the newest (default 200)",
    )
    events.add_argument("-o", "--output", choices=["json"])
    events.set_defaults(func=cmd_events)
