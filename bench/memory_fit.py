"""The fit ledger's estimate against the resident memory of real engine workers.

    python bench/memory_fit.py [--model PATH] [--threads 1]

For each of three sizes of `slots x contextPerSlot`, starts one `python -m
blazar.engine` worker with the bundled model, waits for READY (its warm-up decode has
touched every weight page), then loads it the way the estimate's worst case assumes:
every slot prefills a prompt longer than one 512-token micro-batch and decodes, one of
them asking for prompt logprobs (which grows the context's output buffer to its
bound). Resident memory is read from /proc/PID/status after READY and after the load:
VmRSS, and its anonymous (KV cache, buffers, heap) and file-backed (mapped weights,
shared libraries) parts. Mapped weights count in VmRSS only once touched, which the
warm-up decode does for all of them.

Prints one line per size and the ratio estimate / measured; acceptance 1 of issue 20
asks for every ratio within 0.75 to 1.25. A fourth line runs the middle size with the
draft model beside the target (a SpecPair of kind `model`), when its file is there
(`tools/make_draft.py` makes it), to check the estimate's draft term.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from blazar._proto.v1 import inference_pb2  # noqa: E402
from blazar.api.kinds import LaneSpec  # noqa: E402
from blazar.api.replicas import EngineLaunch, LaunchSpec, SpeculationLaunch  # noqa: E402
from blazar.controller import fit, hostmemory, modelfile  # noqa: E402

MODEL = REPO / ".cache" / "models" / "gemma-3-270m-q4_k_m.gguf"
DRAFT = REPO / ".cache" / "models" / "gemma-3-270m-q4_k_m.draft-q4_0.gguf"
SIZES = [(1, 1024), (4, 2048), (8, 8192)]
MIB = 1024 * 1024


def shape_of(model: Path) -> fit.ModelShape:
    info = modelfile.read_gguf(model)
    shape = fit.ModelShape.of_parameters(info.parameters, size_bytes=model.stat().st_size)
    assert shape is not None, info.parameters
    return shape


async def ready(stub: engine_pb2_grpc.EngineStub, *, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            health = await stub.Health(engine_pb2.HealthRequest(), timeout=2)
            if health.state == engine_pb2.ENGINE_STATE_READY:
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("worker not ready")
        await asyncio.sleep(0.1)


async def generate(stub: engine_pb2_grpc.EngineStub, prompt: str, *, prompt_logprobs: bool) -> None:
    sampling = inference_pb2.Sampling(
        temperature=0.0, max_tokens=8, prompt_logprobs=prompt_logprobs
    )
    async for _ in stub.Generate(engine_pb2.GenerateRequest(prompt=prompt, sampling=sampling)):
        pass


async def measure(
    launch: LaunchSpec, pid: int, socket: str
) -> tuple[hostmemory.Resident, hostmemory.Resident]:
    memory = hostmemory.ProcMemory()
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        await ready(stub)
        warm = memory.resident(pid)
        # A prompt past one micro-batch, within the slot (" one" is one token).
        words = min(700, launch.context_per_slot - 64)
        prompt = "Count:" + " one" * words
        await asyncio.gather(
            *(generate(stub, prompt, prompt_logprobs=i == 0) for i in range(launch.slots))
        )
        loaded = memory.resident(pid)
    assert warm is not None and loaded is not None
    return warm, loaded


def run(
    model: Path, slots: int, context_per_slot: int, threads: int, *, draft: Path | None = None
) -> tuple[int, int]:
    lane = LaneSpec(model="m", slots=slots, contextPerSlot=context_per_slot, threads=threads)
    speculation = None
    if draft is not None:
        speculation = SpeculationLaunch(
            kind="model", max_draft_tokens=8, disable_above_batch=4, min_acceptance_rate=0.3,
            draft_model_path=str(draft),
        )  # fmt: skip
    launch = LaunchSpec.of_lane(
        lane, model_path=str(model), default_threads=threads, speculation=speculation
    )
    socket = str(Path(tempfile.mkdtemp(prefix="bz-", dir="/tmp")) / "engine.sock")
    doc = EngineLaunch(spec=launch, socket=socket, drain_grace_seconds=10.0)
    worker = subprocess.Popen(
        [sys.executable, "-m", "blazar.engine", "--launch", "-"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert worker.stdin is not None
    worker.stdin.write(doc.to_json())
    worker.stdin.close()
    try:
        warm, loaded = asyncio.run(measure(launch, worker.pid, socket))
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    est = fit.estimate(
        launch, shape_of(model), draft=shape_of(draft) if draft is not None else None
    )
    measured = loaded.total
    others = est.total - est.runtime
    print(
        f"slots {slots:>2} x contextPerSlot {context_per_slot:>5}"
        f"{' + draft model' if draft is not None else ''}: "
        f"estimate {est.total / MIB:7.1f} MiB (weights {est.weights / MIB:.1f}, "
        f"kv {est.kv / MIB:.1f}, compute {est.compute / MIB:.1f}, "
        f"draft {est.draft / MIB:.1f}, runtime {est.runtime / MIB:.1f}); "
        f"VmRSS ready {warm.total / MIB:7.1f}, loaded {measured / MIB:7.1f} MiB "
        f"(anon {loaded.anonymous / MIB:.1f}, file {(loaded.total - loaded.anonymous) / MIB:.1f}); "
        f"estimate/measured {est.total / measured:.3f}; "
        f"measured less the other terms {(measured - others) / MIB:.1f} MiB",
        flush=True,
    )
    return est.total, measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--draft", type=Path, default=DRAFT)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ratios = [
        estimate / measured
        for estimate, measured in (
            run(args.model, slots, ctx, args.threads) for slots, ctx in SIZES
        )
    ]
    worst = max(abs(r - 1) for r in ratios)
    verdict = "passes" if worst <= 0.25 else "FAILS"
    print(f"largest estimate error {worst:.3f} (acceptance: 0.25): {verdict}")
    if args.draft.is_file():
        estimate, measured = run(args.model, *SIZES[1], args.threads, draft=args.draft)
        print(f"with the draft model: estimate error {abs(estimate / measured - 1):.3f}")


if __name__ == "__main__":
    main()
