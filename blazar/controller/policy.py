"""Reconciler for the kinds that run nothing themselves (SLOPolicy, SpecPair).

They are read by Lanes and the data plane; this only reports that the controller has
seen the current generation and whether the objects they name exist (`ResolvedRefs`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from blazar.api import conditions
from blazar.api.kinds import Kind, ModelDraft, SpecPair
from blazar.api.meta import ConditionStatus
from blazar.controller.reconciler import Result
from blazar.store.base import Store


def missing_refs(obj: object, exists: Callable[[Kind, str], bool]) -> list[str]:
    if not isinstance(obj, SpecPair):
        return []
    wanted = [obj.spec.target]
    if isinstance(obj.spec.draft, ModelDraft):
        wanted.append(obj.spec.draft.model)
    return [f'Model "{name}"' for name in wanted if not exists(Kind.MODEL, name)]


class PolicyReconciler:
    def __init__(self, *, kind: Kind, store: Store, clock: Callable[[], datetime]) -> None:
        self.kind = kind
        self._store = store
        self._clock = clock

    async def reconcile(self, name: str) -> Result:
        obj = self._store.get(self.kind, name)
        if obj is None:
            return Result()
        missing = missing_refs(obj, lambda k, n: self._store.get(k, n) is not None)
        generation = obj.metadata.generation or 0
        status = obj.status.model_copy()
        status.observed_generation = generation
        status.conditions = conditions.set_condition(
            obj.status.conditions,
            type="ResolvedRefs",
            status=ConditionStatus.FALSE if missing else ConditionStatus.TRUE,
            reason="RefNotFound" if missing else "AllRefsResolved",
            message=(", ".join(missing) + " not found.") if missing else "Every reference exists.",
            observed_generation=generation,
            now=self._clock(),
        )
        self._store.update_status(self.kind, name, status)
        return Result()
