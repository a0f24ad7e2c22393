"""`blazar serve`: wires store, supervisor, controller, gRPC data plane, HTTP shim and
the GitOps watcher into one asyncio process, and takes them down in reverse order.

Once listening it writes `$BLAZAR_HOME/daemon.json` with its pid and the addresses it
actually bound (port 0 picks free ports), which is how tests and tools find it. It
holds `$BLAZAR_HOME/daemon.lock` for its whole life: one daemon per home.

The fleet is its owner's (docs/SECURITY.md): Control is served on the Unix socket
`$BLAZAR_HOME/control.sock` (0600), and over TCP only to an admin key. Without an auth
file (`--auth-file`) there are no keys, and `serve` refuses to listen anywhere but on
loopback. With one, its tenants' keys are checked by the data plane
(`blazar.dataplane.access`), and the file is read again whenever it changes: a file
that no longer reads keeps the one before in force, and says why (log and event).
With `--tls-cert` and `--tls-key` the HTTP shim serves HTTPS and the TCP gRPC listener
TLS (`blazar.rpc.tls`); the Unix sockets stay plain.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import watchfiles

from blazar.api import errors, tenants
from blazar.api.kinds import Kind
from blazar.cli import home as home_
from blazar.cli import homelock
from blazar.controller import hostmemory, modelcache, residency, sources
from blazar.controller.lane import LaneReconciler
from blazar.controller.manager import Manager
from blazar.controller.model import ModelReconciler
from blazar.controller.policy import PolicyReconciler
from blazar.dataplane import access
from blazar.dataplane import server as dataplane_server
from blazar.enginehost import cores, monitor
from blazar.enginehost.activity import Activity
from blazar.enginehost.offload import GpuOffload
from blazar.enginehost.supervisor import Supervisor
from blazar.enginehost.upstream import UpstreamPool
from blazar.gitops import watcher
from blazar.rpc import tls
from blazar.store.sqlite import SQLiteStore

if TYPE_CHECKING:
    import uvicorn

log = structlog.get_logger(__name__)

DEFAULT_HTTP = "127.0.0.1:8420"
DEFAULT_GRPC = "127.0.0.1:8421"


default_home = home_.default_home
control_socket = home_.control_socket


def default_model_cache() -> Path:
    """Where packaged models are assembled once for every home of this machine."""
    return modelcache.default_root()


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address '{address}' is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def join_address(host: str, port: int) -> str:
    """HOST:PORT as gRPC targets and URLs spell it: an IPv6 address in brackets, as
    `split_address` took it ("::1:8421" resolves as no host at all)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_addresses(options: Options) -> None:
    """InvalidRequest (one line, naming the flag) when --http or --grpc is not HOST:PORT
    with a port from 0 to 65535, before anything reads them."""
    for flag, address in (("--http", options.http), ("--grpc", options.grpc)):
        try:
            split_address(address)
        except ValueError:
            raise errors.InvalidRequest(
                f"{flag} {address!r} is not HOST:PORT (a port from 0 to 65535; 0 picks a free one)"
            ) from None


@dataclass(frozen=True)
class Options:
    home: Path
    http: str = DEFAULT_HTTP
    grpc: str = DEFAULT_GRPC
    watch: Path | None = None
    # Delete objects the watched directory applied once their file no longer holds them.
    prune: bool = True
    log_json: bool = True
    # The machine's model cache (`modelcache`); None: packages assembled into the home.
    model_cache: Path | None = None
    # Directories a Model's `source.path` may name files under, besides the home's
    # models/ and $BLAZAR_MODEL_ROOTS (`sources`).
    model_roots: tuple[Path, ...] = ()
    # Tenants and their keys (`blazar.api.tenants`); None: no keys, loopback only.
    auth_file: Path | None = None
    # Origins whose web pages may call the HTTP shim (CORS); none by default.
    allow_origins: tuple[str, ...] = ()
    # PEM certificate chain and private key: HTTPS and gRPC over TLS. Both or neither.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Bytes every engine together may hold (None: what the host has), and how long a
    # Lane stays loaded before the budget may put it to sleep for another (`residency`).
    memory_budget: int | None = None
    min_residency_s: float | None = None  # None: residency.DEFAULT_MIN_RESIDENCY_S


def _now() -> datetime:
    return datetime.now(UTC)


# The flag and the variable that choose each listener's address, for the error that
# says it is taken: `make up` takes no flags, so the variable is its only way.
_ADDRESS_SETTINGS = {"HTTP": ("--http", "BLAZAR_HTTP_ADDR"), "gRPC": ("--grpc", "BLAZAR_GRPC_ADDR")}


def _cannot_listen(address: str, what: str, reason: str) -> errors.Unavailable:
    flag, variable = _ADDRESS_SETTINGS[what]
    return errors.Unavailable(
        f"cannot listen on {address} ({what}): {reason}; give another address with "
        f"{flag} HOST:PORT or {variable}"
    )


def _listen(address: str, *, what: str) -> socket.socket:
    """A socket bound to address and listening; Unavailable when the address is taken
    (or not this host's), so `serve` says so in one line instead of a traceback."""
    host, port = split_address(address)
    # IPPROTO_TCP by name, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    # on sockets whose proto says TCP, and accepted sockets inherit it. With proto 0 every
    # response on a kept-alive connection whose head and body are two writes waited for
    # the client's delayed ACK: 40 ms more per request, and streamed chunks in clumps.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        # Listening at once: on Linux two SO_REUSEADDR sockets may both bind a port
        # until one of them listens.
        sock.listen()
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)  # "Address already in use"
        raise _cannot_listen(address, what, reason[:1].lower() + reason[1:]) from None
    return sock


def _loopback(host: str) -> bool:
    """Whether every address `host` names is this host's loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(a[4][0]).is_loopback for a in found)


def check_exposure(options: Options) -> None:
    """Without keys, nothing listens beyond this host: InvalidRequest (one line) when an
    address is not loopback and no auth file is given."""
    if options.auth_file is not None:
        return
    for flag, address in (("--http", options.http), ("--grpc", options.grpc)):
        host, _ = split_address(address)
        if not _loopback(host):
            raise errors.InvalidRequest(
                f"{flag} {address} is reachable from other hosts, and this server has no "
                "API keys: pass --auth-file FILE (docs/SECURITY.md), or listen on "
                "127.0.0.1"
            )


def read_certificate(options: Options) -> tls.Certificate | None:
    """The TLS certificate `options` names (None: plain text); InvalidRequest (one
    line) when only one of the two files is named or they do not read as a pair."""
    if options.tls_cert is None and options.tls_key is None:
        return None
    if options.tls_cert is None or options.tls_key is None:
        given, missing = (
            ("--tls-cert", "--tls-key") if options.tls_key is None else ("--tls-key", "--tls-cert")
        )
        raise errors.InvalidRequest(f"{given} needs {missing} too (TLS takes both files)")
    return tls.load(options.tls_cert, options.tls_key)


def read_auth_file(path: Path) -> tenants.Tenants:
    """The tenants of the auth file at `path`; InvalidRequest (one line) otherwise."""
    return _parse_auth_file(_auth_file_text(path), path)


def auth_file_problem(st: os.stat_result, *, uid: int) -> str | None:
    """Why an auth file with this stat() may not be trusted; None: it may. Whoever can
    write the file can give themselves a key, or make their tenant admin and so reach
    Control over TCP; so, as ssh does with `authorized_keys`, a file another user may
    write is refused: one owned by someone other than this user or root, or writable by
    everyone. Reading it gives nothing away (it holds digests, never keys)."""
    if st.st_uid not in (uid, 0):
        return f"it belongs to uid {st.st_uid}, not this user ({uid}) or root"
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return f"anyone may write it (mode {mode:04o}); chmod o-w it"
    return None


def _auth_file_text(path: Path) -> str:
    try:
        with path.open() as file:
            problem = auth_file_problem(os.fstat(file.fileno()), uid=os.geteuid())
            text = file.read()
    except OSError as exc:
        raise errors.InvalidRequest(f"--auth-file: cannot read {path}: {exc.strerror}") from None
    if problem is not None:
        raise errors.InvalidRequest(f"--auth-file {path}: not used, as {problem}")
    return text


def _parse_auth_file(text: str, path: Path) -> tenants.Tenants:
    try:
        return tenants.parse(text, source=str(path))
    except tenants.AuthFileInvalid as exc:
        raise errors.InvalidRequest(str(exc)) from None


# How often a follower whose auth file's directory is gone looks for it again.
AUTH_FILE_RETRY_S = 1.0


def auth_file_dirs(path: Path) -> frozenset[Path]:
    """The directories to watch for changes to what the auth file at `path` reads: its
    own, and its target's when it is (or goes through) a symbolic link. The link's side
    sees a link re-pointed (`ln -sfn`, Kubernetes' `..data` swap of a mounted Secret),
    the target's side a target edited where it lies. Only directories that exist."""
    return frozenset(d for d in (path.parent, path.resolve().parent) if d.is_dir())


async def _follow_auth_file(
    path: Path, gate: access.Access, store: SQLiteStore, stop: asyncio.Event
) -> None:
    """Put the auth file in force again whenever what it reads changes, until `stop`. A
    file that does not read (half written, a typo) keeps the tenants in force; the log
    and an event (`blazar events`) say why. `path` is followed as given, not resolved
    once: a symbolic link is read through again on every change, and the watch moves
    with its target (`auth_file_dirs`). Directories are watched, not the file: editors
    and config tools replace a file by renaming another over it. What the file reads is
    compared with what was read last, so a change beside it does nothing."""
    path = path.absolute()
    # What `serve` put in force at its start: a change beside the file reloads nothing.
    seen, _ = _reading(path)
    while not stop.is_set():
        dirs = auth_file_dirs(path)
        if not dirs:  # its directory is gone: nothing to watch until it is back
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), AUTH_FILE_RETRY_S)
            continue
        async for _ in watchfiles.awatch(*dirs, stop_event=stop, debounce=200, step=50):
            seen = _reload_auth_file(path, gate, store, seen=seen)
            if auth_file_dirs(path) != dirs:
                break  # the link points elsewhere now: watch where it points


def _reading(path: Path) -> tuple[str, errors.BlazarError | None]:
    """What the auth file reads now: its text, or why it cannot be used (the message,
    and the error)."""
    try:
        return _auth_file_text(path), None
    except errors.BlazarError as err:
        return err.message, err


def _reload_auth_file(path: Path, gate: access.Access, store: SQLiteStore, *, seen: str) -> str:
    """Read the auth file again and put it in force if it reads otherwise than `seen`
    (what the last reading found, or its error); what this reading found."""
    found, problem = _reading(path)
    if found == seen:
        return seen
    if problem is None:
        try:
            fresh = _parse_auth_file(found, path)
        except errors.BlazarError as err:
            problem = err
        else:
            gate.use(fresh)
            log.info("auth.reloaded", path=str(path), tenants=len(fresh.tenants))
            store.record_event(
                kind="AuthFile",
                name=path.name,
                type="Normal",
                reason="AuthFileLoaded",
                message=(
                    f"{len(fresh.tenants)} tenant{'' if len(fresh.tenants) == 1 else 's'} "
                    f"in force from {path}."
                ),
            )
            return found
    log.warning("auth.rejected", path=str(path), error=problem.message)
    store.record_event(
        kind="AuthFile",
        name=path.name,
        type="Warning",
        reason="AuthFileRejected",
        message=f"{problem.message}; the tenants read before stay in force.",
    )
    return found


# How often engine logs are checked against their size cap (`logfiles`).
LOG_ROTATE_INTERVAL_S = 1.0


async def _rotate_logs(supervisor: Supervisor, stop: asyncio.Event) -> None:
    """Keep every engine log under its cap until `stop`."""
    while not stop.is_set():
        # In the loop, not a thread: the supervisor's replicas are the loop's to read.
        supervisor.rotate_logs()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), LOG_ROTATE_INTERVAL_S)


async def run(options: Options) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP.

    First the home is locked (`homelock.exclusive`), then both addresses are checked, before
    anything else starts: a home in use or a taken port ends `serve` with Unavailable,
    nothing to undo, and the home as it was (not even created).

    Everything the daemon and its engines write is the owner's alone (umask 077): the
    store, logs, engine sockets and saved KV caches, which hold prompts' tokens. A home
    made readable by others before is tightened on start.
    """
    check_addresses(options)
    check_exposure(options)
    keys = read_auth_file(options.auth_file) if options.auth_file is not None else None
    certificate = read_certificate(options)
    home = options.home
    created = not home.exists()
    os.umask(0o077)
    try:
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:  # a file in the way, no permission, ...
        raise errors.Unavailable(f"cannot use {home} as BLAZAR_HOME: {exc.strerror}") from None
    try:
        with homelock.exclusive(home):
            http_sock = _listen(options.http, what="HTTP")
            try:
                # Only a check: grpcio binds its own socket. Asked first, it would log
                # its refusal to stderr in C-core's format before the line `serve` prints.
                _listen(options.grpc, what="gRPC").close()
                homelock.tighten(home)
                await _serve(options, http_sock, keys, certificate)
            finally:
                http_sock.close()
    finally:
        if created:
            with contextlib.suppress(OSError):  # not empty: the daemon ran and wrote state
                home.rmdir()


def _shim(
    grpc_target: str,
    *,
    probe_key: str,
    allow_origins: tuple[str, ...],
    certificate: tls.Certificate | None,
    require_key: Callable[[str | None], None],
) -> uvicorn.Server:
    """The HTTP shim's server, imported only when it starts (see `_serve`). With a
    certificate it serves HTTPS, and reaches the data plane's TLS listener with it."""
    import uvicorn

    from blazar.shim import connections
    from blazar.shim.app import create_app

    credentials, channel_options = (
        certificate.loopback_channel() if certificate is not None else (None, ())
    )

    class Server(uvicorn.Server):
        # The daemon owns its signals (`_serve`). uvicorn's own capture would also
        # raise each signal it saw again once the shim has stopped, which the daemon
        # would take for a second one.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(
        uvicorn.Config(
            create_app(
                inference_target=grpc_target,
                probe_key=probe_key,
                allow_origins=allow_origins,
                inference_credentials=credentials,
                channel_options=channel_options,
                require_key=require_key,
            ),
            ssl_certfile=certificate.cert_path if certificate is not None else None,
            ssl_keyfile=certificate.key_path if certificate is not None else None,
            # uvicorn's loggers go to the root logger, which `logs` renders: uvicorn's
            # own configuration would print them in its own text format.
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="on",
            # httptools, with a deadline on reading requests and a bound on their heads.
            http=connections.BoundedHttpToolsProtocol,
            limit_concurrency=connections.LIMIT_CONCURRENCY,
        )
    )


# What `serve` writes once listening (`write_info`), and removes when it stops.
INFO_FILE = "daemon.json"


def write_info(home: Path, info: Mapping[str, object]) -> None:
    """`$BLAZAR_HOME/daemon.json`: `info` as one line of JSON, ended by a newline as a
    text file is (`cat` and shell `read` expect one). Written whole, then renamed: a
    reader (the CLI, a test harness, a supervisor script) never sees a half-written
    file."""
    staged = home / (INFO_FILE + ".tmp")
    staged.write_text(json.dumps(info) + "\n")
    os.replace(staged, home / INFO_FILE)


async def _serve(
    options: Options,
    sock: socket.socket,
    keys: tenants.Tenants | None,
    certificate: tls.Certificate | None,
) -> None:
    home = options.home
    store = SQLiteStore(home / "state.db")
    model_sources = sources.roots_from_environment(home, options.model_roots)
    offload = GpuOffload()
    store.admission = lambda objects: [
        *model_sources.problems(objects),
        *offload.problems(objects),
        *cores.problems(objects, cpus=cores.count()),
    ]
    if store.recovered_from is not None:
        message = (
            f"{home / 'state.db'} could not be read as a store; it was moved to "
            f"{store.recovered_from} and a new store started. Apply the fleet's manifests "
            "again (a watched directory is applied at once)."
        )
        log.warning("store.recovered", moved_to=str(store.recovered_from))
        store.record_event(
            kind="Store", name="state.db", type="Warning", reason="StoreRecovered", message=message
        )
    for (kind, name), error in store.unreadable_rows().items():
        store.record_event(
            kind=kind,
            name=name,
            type="Warning",
            reason="StoredObjectUnreadable",
            message=(
                f'The stored {kind} "{name}" does not validate in this version of Blazar '
                "(another version wrote it, or it is damaged), so it is skipped: no get, "
                f"list or reference finds it. Apply it again to replace it. {error}"
            ),
        )
    manager: Manager | None = None

    def lane_changed(lane: str) -> None:
        if manager is not None:
            manager.enqueue(Kind.LANE, lane)

    supervisor = Supervisor(home=home, on_change=lane_changed, log_json=options.log_json)
    # Requests per Lane, for idle.sleepAfter, keep_alive and residency: the data plane
    # counts, the controller sleeps and wakes Lanes by it.
    activity = Activity()
    activity.on_change(lane_changed)
    # The controller's probes of upstream Lanes; the data plane has its own clients.
    probes = UpstreamPool(keys=home_.keys_dir(home))
    manager = Manager(
        store=store,
        reconcilers=[
            ModelReconciler(
                store=store,
                models_dir=home / "models",
                clock=_now,
                cache=modelcache.ModelCache(options.model_cache),
                sources=model_sources,
            ),
            LaneReconciler(
                store=store,
                processes=supervisor,
                clock=_now,
                memory=hostmemory.ProcMemory(),
                activity=activity,
                budget=options.memory_budget,
                min_residency_s=(
                    residency.DEFAULT_MIN_RESIDENCY_S
                    if options.min_residency_s is None
                    else options.min_residency_s
                ),
                notify=lane_changed,
                probes=probes,
                file_exists=os.path.exists,
            ),
            PolicyReconciler(kind=Kind.SLO_POLICY, store=store, clock=_now),
            PolicyReconciler(kind=Kind.SPEC_PAIR, store=store, clock=_now),
        ],
        leftovers=lambda: [(Kind.LANE, lane) for lane in supervisor.kv_lanes()],
    )
    # The readiness probe's key: in memory only, good for listing models (`access`).
    probe_key = secrets.token_urlsafe(32)
    gate = access.Access(tenants=keys, probe_key=probe_key)
    socket_path = control_socket(home)
    health = monitor.HealthMonitor(
        observe=lambda: [r for lane in sorted(supervisor.lanes()) for r in supervisor.observe(lane)]
    )
    try:
        plane = await dataplane_server.start(
            store=store,
            # As `split_address` reads it, like the HTTP listener: an empty host is
            # 127.0.0.1 (grpcio refuses ":PORT").
            address=join_address(*split_address(options.grpc)),
            access=gate,
            control_socket=socket_path,
            activity=activity,
            log_dir=supervisor.log_dir,
            engines=lambda: health.latest,
            credentials=certificate.server_credentials() if certificate is not None else None,
            upstreams=UpstreamPool(keys=home_.keys_dir(home)),
        )
    except OSError as exc:
        # Taken since the check in `run` (grpcio does not say why), or the home's path
        # is too long for a Unix socket.
        store.close()
        if "Unix socket" in str(exc):
            raise errors.Unavailable(f"{exc}; use a shorter --home") from None
        raise _cannot_listen(options.grpc, "gRPC", "grpcio could not bind it") from None
    grpc_host, _ = split_address(options.grpc)
    grpc_target = join_address(grpc_host, plane.port)

    http_host, _ = split_address(options.http)
    http_bound = join_address(http_host, sock.getsockname()[1])

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        # A second signal while stopping (Ctrl-C pressed again, a service manager's
        # second SIGTERM) stops now: engines killed, not waited on through the drain.
        if stop.is_set():
            log.warning("daemon.hurried")
            supervisor.hurry()
        stop.set()

    # SIGHUP (the terminal closed, or a service manager's reload) drains like SIGTERM:
    # its default action would end the daemon at once, engines and streams cut off.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)

    if options.watch is not None:
        # Before the controllers start: a manifest edited while the daemon was down
        # must not first start (then replace) an engine from the stored spec.
        watcher.sync(store, options.watch, prune=options.prune)
    await manager.start()
    # The HTTP shim after the controllers, so that its imports (uvicorn, Starlette, the
    # dialects: 0.1 s of CPU, several times that on a busy host) run beside the first
    # engine's start rather than before its spawn. Its socket already listens: a client
    # that connects meanwhile waits in the backlog, it is not refused.
    shim = _shim(
        grpc_target,
        probe_key=probe_key,
        allow_origins=options.allow_origins,
        certificate=certificate,
        require_key=gate.require_key,
    )
    shim_task = asyncio.create_task(shim.serve(sockets=[sock]), name="shim")
    monitor_task = asyncio.create_task(health.run(stop), name="engine-health")
    rotate_task = asyncio.create_task(_rotate_logs(supervisor, stop), name="engine-logs")
    auth_task = None
    if options.auth_file is not None:
        auth_task = asyncio.create_task(
            _follow_auth_file(options.auth_file, gate, store, stop), name="auth-file"
        )
    gitops_task = None
    if options.watch is not None:
        gitops_task = asyncio.create_task(
            watcher.watch(store, options.watch, stop, prune=options.prune), name="gitops"
        )

    while not shim.started and not shim_task.done():
        await asyncio.sleep(0.02)
    info = {
        "pid": os.getpid(),
        "grpc": grpc_target,
        "http": http_bound,
        "control": f"unix:{socket_path}",
        "home": str(home),
        # HTTPS and gRPC over TLS on the TCP addresses above.
        "tls": certificate is not None,
    }
    write_info(home, info)
    log.info("daemon.serving", **info)

    await stop.wait()
    log.info("daemon.stopping")
    shim.should_exit = True
    await plane.set_serving(False)
    # Nothing waiting starts any more (the engines drain, then stop): refused now, with
    # a reason to retry, not held through the drain and cut off at the end.
    plane.inference.refuse_waiting()
    if gitops_task is not None:
        try:
            await gitops_task
        except Exception:
            # The watch died (its directory removed, say); the teardown below must run.
            log.exception("gitops.failed")
    await monitor_task
    await rotate_task
    if auth_task is not None:
        try:
            await auth_task
        except Exception:
            log.exception("auth.watch_failed")
    await manager.stop()
    await probes.close()
    await supervisor.stop_all()
    await plane.stop(grace=5)
    with contextlib.suppress(asyncio.CancelledError):
        await shim_task
    store.close()
    # Gone, or a home turned read-only: the next start replaces both.
    with contextlib.suppress(OSError):
        (home / INFO_FILE).unlink()
    with contextlib.suppress(OSError):
        socket_path.unlink()
    log.info("daemon.stopped")
