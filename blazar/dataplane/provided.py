"""What `inference.InferenceService` provides to the modules its servicer is split
into (`listing`, `spillover`, `relaying`, `unqueued`): its route table, checks,
refusal, routing and cache estimate, declared here once and implemented by the
service itself, which comes first in its own method order (`tests/unit/test_mixins.py`
checks that no declaration below hides the real method)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, NoReturn, TypeAlias

from blazar.api import errors
from blazar.dataplane import access, admission, dispatcher, routing

# grpc.aio's servicer context.
Context: TypeAlias = Any


class Provided:
    """The service's parts its mixins call (see the module docstring)."""

    @property
    def table(self) -> routing.RouteTable:
        raise NotImplementedError

    async def _permit(self, model: str, context: Context, caller: access.Caller) -> None:
        raise NotImplementedError

    async def _policy(
        self, model: str, slo: str, context: Context, caller: access.Caller
    ) -> admission.Policy:
        raise NotImplementedError

    async def _keep_alive(
        self, model: str, keep_alive_s: float | None, context: Context, caller: access.Caller
    ) -> None:
        raise NotImplementedError

    async def _count(self, model: str, context: Context, caller: access.Caller) -> None:
        raise NotImplementedError

    async def _refuse(
        self, context: Context, err: errors.BlazarError, caller: access.Caller | None
    ) -> NoReturn:
        raise NotImplementedError

    async def _route(
        self,
        model: str,
        context: Context,
        *,
        session: str = "",
        hashes: Callable[[int], tuple[int, ...]] | None = None,
        caller: access.Caller | None = None,
        generation: bool = False,
    ) -> tuple[routing.Route, routing.Replica | None, tuple[int, ...]]:
        raise NotImplementedError

    def _pick(
        self,
        route: routing.Route,
        *,
        session: str = "",
        hashes: Sequence[int] = (),
        exclude: Collection[int] = (),
    ) -> routing.Replica:
        raise NotImplementedError

    def _cached_tokens(
        self,
        lane_name: str,
        lane: dispatcher.LaneDispatcher,
        replica: routing.Replica | None,
        hashes: Sequence[int],
    ) -> int:
        raise NotImplementedError

    def _served(self, replica: routing.Replica, hashes: Sequence[int]) -> None:
        raise NotImplementedError
