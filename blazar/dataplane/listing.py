"""ListModels: the Lanes a caller may use, by each name that reaches them, with their
readiness, sleep, size and what their Model's file is (`model_file`).

`Listing` is mixed into `inference.InferenceService`: its methods read the service's
route table (declared in `provided`), store and activity ledger; the split is only
of the text.
"""

from __future__ import annotations

import time
from typing import Any, TypeAlias

from blazar._proto.v1 import inference_pb2
from blazar.api import filetypes
from blazar.api.kinds import Kind, Model
from blazar.dataplane import access, provided, routing
from blazar.enginehost.activity import Activity, sleeps_in
from blazar.store.base import Store

# grpc ships no type information; its servicer context is dynamically typed.
Context: TypeAlias = Any


def model_file(model: Model) -> inference_pb2.ModelFile | None:
    """What ListModels says of a Model's file; None until its controller inspected it."""
    status = model.status
    if status.size_bytes is None:
        return None
    params = status.parameters

    def number(key: str) -> int:
        value = params.get(key, "")
        return int(value) if value.isascii() and value.isdigit() else 0

    return inference_pb2.ModelFile(
        size_bytes=status.size_bytes,
        sha256=status.sha256 or "",
        modified=(status.mtime_ns or 0) // 1_000_000_000,
        architecture=status.architecture or "",
        name=params.get("name", ""),
        parameter_size=params.get("size_label", ""),
        quantization=filetypes.quantization(params.get("file_type")),
        trained_context_length=status.context_length or 0,
        embedding_length=number("embedding_length"),
        block_count=number("block_count"),
        head_count=number("attention.head_count"),
        head_count_kv=number("attention.head_count_kv"),
        has_chat_template=params.get("has_chat_template") == "true",
    )


class Listing(provided.Provided):
    """ListModels of `InferenceService` (see the module docstring)."""

    _store: Store
    _activity: Activity

    # The listing.

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: Context
    ) -> inference_pb2.ListModelsResponse:
        models = []
        caller = access.current()
        for route in self.table.routes:
            if not caller.may_use((route.lane, *route.aliases)):
                continue
            stored = self._store.get(Kind.MODEL, route.model)
            file = model_file(stored) if isinstance(stored, Model) else None
            for name in (route.lane, *route.aliases):
                if self.table.by_name.get(name) is not route:
                    continue
                models.append(
                    inference_pb2.ModelInfo(
                        id=name,
                        lane=route.lane,
                        model=route.model,
                        ready=bool(route.replicas),
                        sleeping=route.sleeping and not route.replicas,
                        upstream=route.upstream is not None,
                        sleeps_in_s=self._sleeps_in(route),
                        created=route.created,
                        context_length=route.context_length,
                        replicas=route.desired,
                        ready_replicas=len(route.replicas),
                        slots=route.slots,
                        file=file,
                    )
                )
        return inference_pb2.ListModelsResponse(models=models)

    def _sleeps_in(self, route: routing.Route) -> float | None:
        """When the Lane falls asleep if no request comes (None: nothing will put it)."""
        if route.preload or route.upstream is not None or not route.replicas:
            return None
        lane = route.lane
        return sleeps_in(
            sleep_after_s=route.sleep_after_s,
            idle_s=self._activity.idle_s(
                lane, age_s=time.time() - route.created if route.created else None
            ),
            in_flight=self._activity.in_flight(lane),
            keep=self._activity.keep(lane),
        )
