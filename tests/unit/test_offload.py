"""`spec.gpuLayers` on a host whose llama.cpp cannot offload is refused at apply, by
name; the build is asked once, and only when a Lane asks for layers."""

from __future__ import annotations

import llama_cpp
import pytest

from blazar.api import errors
from blazar.api.kinds import Kind, Lane, LaneSpec
from blazar.api.meta import ObjectMeta
from blazar.enginehost import offload
from blazar.store import apply
from blazar.store.memory import MemoryStore


def lane(name: str, layers: int) -> Lane:
    return Lane(metadata=ObjectMeta(name=name), spec=LaneSpec(model="m", gpu_layers=layers))


class Asked:
    def __init__(self, answer: bool | None) -> None:
        self.answer = answer
        self.times = 0

    def __call__(self) -> bool | None:
        self.times += 1
        return self.answer


def test_a_cpu_only_build_refuses_the_lanes_that_ask_for_layers_by_name() -> None:
    ask = Asked(False)
    check = offload.GpuOffload(ask)
    problems = check.problems([lane("cpu", 0), lane("gpu", 20), lane("all", 999)])
    assert [p.path for p in problems] == ["Lane/gpu: spec.gpuLayers", "Lane/all: spec.gpuLayers"]
    assert "20 layers asked, but this host's llama.cpp" in problems[0].message
    assert "Leave gpuLayers out (0) to run on the CPU" in problems[0].message
    check.problems([lane("again", 1)])
    assert ask.times == 1


@pytest.mark.parametrize("answer", [True, None])
def test_a_build_that_offloads_or_cannot_tell_admits_them(answer: bool | None) -> None:
    ask = Asked(answer)
    check = offload.GpuOffload(ask)
    assert check.problems([lane("gpu", 20)]) == []
    check.problems([lane("again", 1)])
    # A yes is kept; a probe that failed is asked again.
    assert ask.times == (1 if answer else 2)


def test_the_build_is_not_asked_when_no_lane_wants_layers() -> None:
    ask = Asked(False)
    assert offload.GpuOffload(ask).problems([lane("cpu", 0), lane("also", 0)]) == []
    assert ask.times == 0


def test_an_apply_with_a_refused_lane_writes_nothing() -> None:
    store = MemoryStore()
    store.admission = offload.GpuOffload(Asked(False)).problems
    head = {"apiVersion": "blazar.dev/v1alpha1"}
    docs = [
        ("a.yaml#1", {**head, "kind": "Model", "metadata": {"name": "m"},
                      "spec": {"source": {"path": "/m.gguf"}}}),
        ("a.yaml#2", {**head, "kind": "Lane", "metadata": {"name": "cpu"},
                      "spec": {"model": "m"}}),
        ("a.yaml#3", {**head, "kind": "Lane", "metadata": {"name": "gpu"},
                      "spec": {"model": "m", "gpuLayers": 8}}),
    ]  # fmt: skip
    with pytest.raises(errors.ManifestInvalid, match=r"Lane/gpu: spec.gpuLayers"):
        apply.apply_documents(store, docs)
    assert store.list(Kind.LANE) == [] and store.list(Kind.MODEL) == []


def test_the_probe_answers_what_the_build_says() -> None:
    """The real probe, in its own process: the same answer as llama.cpp in this one."""
    assert offload.probe() is bool(llama_cpp.llama_supports_gpu_offload())
