"""Anthropic's Models API from the daemon's model list: entries, paging by id, and the
refusals of a bad page or an unknown model."""

from __future__ import annotations

import pytest

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim.anthropic import protocol
from blazar.shim.anthropic.convert import listing

RESPONSE = inference_pb2.ListModelsResponse(
    models=[inference_pb2.ModelInfo(id=name, created=1764547200) for name in "abcde"]
)


def ids(page: protocol.ModelList) -> list[str]:
    return [entry["id"] for entry in page["data"]]


def test_an_entry_has_anthropics_fields() -> None:
    assert listing.find(RESPONSE, "c") == {
        "type": "model",
        "id": "c",
        "display_name": "c",
        "created_at": "2025-12-01T00:00:00Z",
    }
    assert listing.find(RESPONSE, "c:latest")["id"] == "c"


@pytest.mark.parametrize(
    ("query", "expected", "first", "last", "more"),
    [
        ({}, list("abcde"), "a", "e", False),
        ({"limit": "2"}, ["a", "b"], "a", "b", True),
        ({"limit": "2", "after_id": "b"}, ["c", "d"], "c", "d", True),
        ({"limit": "2", "after_id": "c"}, ["d", "e"], "d", "e", False),
        ({"limit": "2", "before_id": "d"}, ["b", "c"], "b", "c", True),
        ({"limit": "5", "before_id": "c"}, ["a", "b"], "a", "b", False),
        ({"after_id": "e"}, [], None, None, False),
    ],
)
def test_pages_by_id(
    query: dict[str, str], expected: list[str], first: str | None, last: str | None, more: bool
) -> None:
    page = listing.page(RESPONSE, query)
    assert (ids(page), page["first_id"], page["last_id"], page["has_more"]) == (
        expected,
        first,
        last,
        more,
    )


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"after_id": "zz"}, "after_id"),
        ({"after_id": "a", "before_id": "b"}, "before_id"),
    ],
)
def test_a_bad_page_is_refused_naming_its_parameter(query: dict[str, str], param: str) -> None:
    with pytest.raises(errors.InvalidRequest) as refused:
        listing.page(RESPONSE, query)
    assert refused.value.metadata[errors.FIELD_KEY] == param


def test_an_unknown_model_is_not_found() -> None:
    with pytest.raises(errors.ModelNotFound):
        listing.find(RESPONSE, "zz")
