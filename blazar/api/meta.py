"""What every resource shares: the API version, object metadata and conditions.

`CamelModel` is the base of every API model: snake_case in Python, camelCase on the
wire (YAML, JSON), unknown fields rejected. Validators here raise
`PydanticCustomError` so that the message users read has no "Value error," prefix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

API_VERSION: Final = "blazar.dev/v1alpha1"
# The same string as a type: mypy does not accept a constant inside Literal[...].
ApiVersion = Literal["blazar.dev/v1alpha1"]

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def is_name(value: str) -> bool:
    """Whether `value` may name an object (a DNS-1123 label, as Kubernetes names)."""
    return bool(_DNS1123_LABEL.match(value))


def invalid(message: str) -> PydanticCustomError:
    """An error for a validator to raise, reported to the user as exactly `message`."""
    # PydanticCustomError formats its template with str.format-style `{}` context;
    # braces in user-supplied text must not be mistaken for placeholders.
    return PydanticCustomError("value_error", message.replace("{", "{{").replace("}", "}}"))


def invalid_at(field: str, message: str, value: object) -> ValidationError:
    """An error for a validator of a model to raise about one of its fields (one that
    checks it against another), reported at that field's path (`spec.spillover`, not
    `spec`) as exactly `message`."""
    return invalid_each([(field, message, value)])


def invalid_each(problems: Sequence[tuple[str, str, object]]) -> ValidationError:
    """`invalid_at` for several fields at once: (field, message, value) each."""
    return ValidationError.from_exception_data(
        "invalid",
        [
            {"type": invalid(message), "loc": (field,), "input": value}
            for field, message, value in problems
        ],
    )


class CamelModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )


class ObjectMeta(CamelModel):
    """Identity and bookkeeping. Users write name, labels and annotations; the store
    sets uid, generation, resourceVersion and creationTimestamp."""

    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    uid: str | None = None
    generation: int | None = None
    resource_version: int | None = None
    creation_timestamp: datetime | None = None

    @field_validator("name")
    @classmethod
    def _dns1123_label(cls, value: str) -> str:
        if not _DNS1123_LABEL.match(value):
            # json.dumps: a name with line breaks stays on its error's one line.
            raise invalid(
                f"{json.dumps(value, ensure_ascii=False)} is not a valid name: use 1 to 63 "
                "lowercase letters, digits and '-', starting and ending with a letter or digit"
            )
        return value


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(CamelModel):
    """One observation about an object, Kubernetes style: `reason` is a CamelCase
    word shown by `get`, `message` a sentence shown by `describe`."""

    # Status is written by the controller and read back from the store; tolerate
    # fields a newer daemon may have added.
    model_config = ConfigDict(extra="ignore")

    type: str
    status: ConditionStatus
    reason: str
    message: str
    last_transition_time: datetime
    observed_generation: int
