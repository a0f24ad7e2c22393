"""Launch specs for tests, as the controller builds them from a Lane."""

from __future__ import annotations

import dataclasses
from typing import Any

from blazar.api.kinds import LaneSpec, NgramDraft, SpecPairSpec
from blazar.api.replicas import EngineLaunch, LaunchSpec, SpeculationLaunch


def spec(model_path: object = "fake.gguf", **overrides: Any) -> LaunchSpec:
    """What a Lane with the API's defaults runs (two threads), with `overrides`."""
    lane = LaneSpec(model="m")
    launch = LaunchSpec.of_lane(lane, model_path=str(model_path), default_threads=2)
    return dataclasses.replace(launch, **overrides)


def ngram(**overrides: Any) -> SpeculationLaunch:
    """An n-gram SpecPair with the API's defaults, as the controller resolves it."""
    pair = SpecPairSpec(target="m", draft=NgramDraft(kind="ngram"))
    return dataclasses.replace(SpeculationLaunch.of_pair(pair), **overrides)


def engine(spec: LaunchSpec, **overrides: Any) -> EngineLaunch:
    """The launch document of one engine process running `spec`, as the supervisor
    writes it, with no KV persistence and no CPU share unless `overrides` give them."""
    return EngineLaunch(spec=spec, socket="engine.sock", drain_grace_seconds=0.0, **overrides)
