"""Lifecycle of one engine worker process: parent watch, gRPC server, signals, teardown.

Start: ask the kernel to SIGKILL us when the parent dies (and exit at once if it is
already gone), serve `blazar.engine.v1.Engine` on the Unix socket (Health answers
STARTING at once), load the model on the decode thread, then report READY.

Everything the worker is configured with comes from its launch document
(`replicas.EngineLaunch`). With a `kv_dir`, slot caches saved by the previous graceful
stop are restored on the decode thread before READY.

Stop (SIGTERM or SIGINT), in order: DRAINING (new Generate calls get UNAVAILABLE),
wait for in-flight requests up to the grace period, cancel whatever is left, stop
the gRPC server, end the decode thread (which saves the slot caches into the
`kv_dir`, then frees the llama context and model), remove the socket, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import signal
from pathlib import Path
from typing import Any

import grpc
import jinja2
import structlog

from blazar import eventloop, logs
from blazar._proto.engine.v1 import engine_pb2_grpc
from blazar.api import kinds, replicas
from blazar.engine import jobs, llama, loop, service, text
from blazar.rpc import limits

log = structlog.get_logger("blazar.engine.worker")

_PR_SET_PDEATHSIG = 1
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107


def die_with_parent(parent_pid: int | None) -> bool:
    """Have the kernel SIGKILL us when the parent exits; False if it already has."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died before prctl took effect; then we were reparented.
    return parent_pid is None or os.getppid() == parent_pid


def main(launch: replicas.EngineLaunch) -> int:
    parent_alive = die_with_parent(launch.parent_pid)
    logs.configure(json=launch.log_json)
    if not parent_alive:
        log.warning("parent_gone", parent_pid=launch.parent_pid, ppid=os.getppid())
        return 1
    llama.quiet_native_logs()
    structlog.contextvars.bind_contextvars(pid=os.getpid())
    if len(launch.socket.encode()) > _MAX_SOCKET_PATH:
        log.error("socket_path_too_long", socket=launch.socket)
        return 2
    return eventloop.run(serve(launch))


async def serve(launch: replicas.EngineLaunch) -> int:
    aio = asyncio.get_running_loop()
    loaded: asyncio.Future[None] = aio.create_future()

    def on_loaded(exc: BaseException | None) -> None:
        aio.call_soon_threadsafe(_settle, loaded, exc)

    # Set when the decode thread failed outside a step and stopped: the worker exits
    # (code 1) for its supervisor to restart it, rather than take work nobody runs.
    failed = asyncio.Event()

    def on_failed(exc: BaseException) -> None:
        aio.call_soon_threadsafe(failed.set)

    spec = launch.spec
    outbox = jobs.Outbox(aio)
    decode = loop.DecodeLoop(
        launch,
        on_loaded=on_loaded,
        outbox=outbox,
        on_failed=on_failed,
    )
    engine = service.EngineService(decode, outbox, model_path=spec.model_path)
    server = grpc.aio.server(options=limits.ENGINE_SERVER_OPTIONS)
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    socket_path = Path(launch.socket)
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)  # stale, from a worker that did not clean up
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio.add_signal_handler(sig, stop.set)
    log.info("starting", model=spec.model_path, socket=launch.socket, slots=spec.slots)
    decode.start()

    stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loaded, stopping], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if loaded.done() and loaded.exception() is not None:
        log.error("model_load_failed", error=str(loaded.exception()))
        code = 1
    elif loaded.done():
        try:
            chat = chat_template(spec.chat_template, decode)
        except jinja2.TemplateError as exc:
            log.error("chat_template_invalid", error=str(exc))
            code = 1
        else:
            engine.mark_ready(chat)
            log.info(
                "ready",
                context_per_slot=decode.context_per_slot,
                kv_bytes=decode.kv_bytes,
                restored_tokens=sum(s.cached_tokens for s in decode.slots),
                chat_template=(
                    "override"
                    if spec.chat_template
                    else ("gguf" if decode.model_chat_template else "fallback")
                ),
                rss=service.rss_bytes(),
            )
    if code == 0:
        dead = asyncio.ensure_future(failed.wait())
        await asyncio.wait([stopping, dead], return_when=asyncio.FIRST_COMPLETED)
        dead.cancel()
        if failed.is_set():
            log.error("decode_loop_failed_exiting")
            code = 1
    stopping.cancel()

    # Returns at once when the supervisor's Drain RPC already did this.
    log.info("draining", grace_seconds=launch.drain_grace_seconds)
    await engine.drain(launch.drain_grace_seconds)
    await server.stop(grace=1.0)
    decode.stop()
    if await asyncio.to_thread(decode.join, 30.0):
        outbox.close()  # else the thread might still flush into a reused descriptor
    with contextlib.suppress(OSError):  # a home turned read-only: the next start replaces it
        socket_path.unlink()
    log.info("stopped", exit_code=code)
    return code


def chat_template(override: str | None, decode: loop.DecodeLoop) -> text.ChatTemplate | None:
    """The chat template to render conversations with; None means Gemma's turns.

    In order: the launch's `chat_template` override (a name from `text.NAMED_TEMPLATES` or an
    inline Jinja template), the GGUF's own template, the architecture's fallback. A
    broken override is fatal; a GGUF template Jinja cannot compile falls back.
    """
    vocab = decode.vocab

    def compiled(source: str | None) -> text.ChatTemplate | None:
        if source is None:
            return None
        return text.ChatTemplate(source, bos_token=vocab.bos_text, eos_token=vocab.eos_text)

    if override:
        if override in text.NAMED_TEMPLATES:
            return compiled(text.NAMED_TEMPLATES[override])
        return compiled(override)
    source = decode.model_chat_template
    if source:
        try:
            return compiled(source)
        except jinja2.TemplateError as exc:
            log.warning("gguf_chat_template_unusable", error=str(exc))
    name = kinds.fallback_template(decode.architecture)
    log.info("chat_template_fallback", architecture=decode.architecture, template=name)
    return compiled(text.NAMED_TEMPLATES[name])


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
        with contextlib.suppress(BaseException):
            future.exception()  # mark retrieved: failure is reported by serve()
