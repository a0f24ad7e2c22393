"""Pure helpers over lists of `meta.Condition`: set one, read one.

Lists are never mutated in place: `set_condition` returns a new list, so a reconciler
can compare old and new status and skip the write when nothing changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from blazar.api.meta import Condition, ConditionStatus


def set_condition(
    conditions: Sequence[Condition],
    *,
    type: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    observed_generation: int,
    now: datetime,
) -> list[Condition]:
    """Return `conditions` with the condition of `type` replaced (in place in the
    order) or appended. `lastTransitionTime` moves only when the status flips, so it
    says how long the object has been in its current state."""
    previous = get_condition(conditions, type)
    since = previous.last_transition_time if previous and previous.status == status else now
    updated = Condition(
        type=type,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=observed_generation,
    )
    if previous is None:
        return [*conditions, updated]
    return [updated if c.type == type else c for c in conditions]


def get_condition(conditions: Sequence[Condition], type: str) -> Condition | None:
    return next((c for c in conditions if c.type == type), None)


def is_true(conditions: Sequence[Condition], type: str) -> bool:
    found = get_condition(conditions, type)
    return found is not None and found.status == ConditionStatus.TRUE
