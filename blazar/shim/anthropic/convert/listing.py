"""Anthropic's Models API (`GET /v1/models`, `GET /v1/models/{model_id}`) from the
daemon's model list: the Lanes and aliases the caller may use, one entry each.

Anthropic pages the list by id (`limit`, 1-1000, default 20; `after_id` for the page
after an id, `before_id` for the one before it); an id the list does not hold is a 404
naming it, as a model that does not exist is. `display_name` is the id: a Lane has no
other name. Pure: the route reads the query and calls the daemon.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.shim import inference
from blazar.shim.anthropic import protocol

DEFAULT_LIMIT = 20
MAX_LIMIT = 1000


def model(info: inference_pb2.ModelInfo) -> protocol.ModelInfo:
    created = datetime.fromtimestamp(max(0, info.created), tz=UTC)
    return {
        "type": "model",
        "id": info.id,
        "display_name": info.id,
        "created_at": created.isoformat().replace("+00:00", "Z"),
    }


def find(response: inference_pb2.ListModelsResponse, name: str) -> protocol.ModelInfo:
    """The entry called `name` (`modelnames.lookups`); ModelNotFound if none."""
    return model(inference.listed_model(response, name))


def page(
    response: inference_pb2.ListModelsResponse, query: Mapping[str, str]
) -> protocol.ModelList:
    """One page of the list as `query` asks (see the module docstring)."""
    entries = [model(info) for info in response.models]
    limit = _limit(query.get("limit"))
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise errors.InvalidRequest(
            "Send after_id or before_id, not both.", metadata={errors.FIELD_KEY: "before_id"}
        )
    if after is not None:
        start = _index(entries, after, "after_id") + 1
        chosen = entries[start : start + limit]
        more = start + limit < len(entries)
    elif before is not None:
        end = _index(entries, before, "before_id")
        chosen = entries[max(0, end - limit) : end]
        more = end - limit > 0
    else:
        chosen = entries[:limit]
        more = limit < len(entries)
    return {
        "data": chosen,
        "first_id": chosen[0]["id"] if chosen else None,
        "last_id": chosen[-1]["id"] if chosen else None,
        "has_more": more,
    }


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise errors.InvalidRequest(
            f"limit: Input should be a whole number from 1 to {MAX_LIMIT}.",
            metadata={errors.FIELD_KEY: "limit"},
        )
    return int(raw)


def _index(entries: Sequence[protocol.ModelInfo], model_id: str, param: str) -> int:
    for i, entry in enumerate(entries):
        if entry["id"] == model_id:
            return i
    raise errors.InvalidRequest(
        f"{param}: no model '{model_id[:200]}' in the list.", metadata={errors.FIELD_KEY: param}
    )
