"""Whether a JSON schema is one at all: the structural check every schema passes first.

Pure. The engine asks it before writing a grammar from a schema (`blazar.engine.schema`)
or reading a tool's parameters, and the Ollama shim asks it of a preload's `format`,
which reaches no engine, so that a schema a generation would refuse is refused there
too, in the same words.
"""

from __future__ import annotations

from typing import Any

from blazar.api import errors


def problem(document: dict[str, Any]) -> tuple[str, str] | None:
    """Where and why `document` is not a valid JSON Schema (by the metaschema of the
    draft its `$schema` names, else 2020-12), or None when it is one."""
    from jsonschema import exceptions, validators

    declared = document.get("$schema")
    # jsonschema looks the name up as a URI: anything but a string raises TypeError.
    if declared is not None and not isinstance(declared, str):
        return "['$schema']", f"{declared!r} is not a string"
    validator = validators.validator_for(document, default=validators.Draft202012Validator)
    try:
        validator.check_schema(document)
    except exceptions.SchemaError as exc:
        return "".join(f"[{p!r}]" for p in exc.path) or " at its top", exc.message
    except OverflowError as exc:
        # The `regex` format check compiles each pattern and catches only re.error;
        # Python's parser raises OverflowError for a repeat such as a{99999999999}.
        return " in a pattern", f"the pattern cannot be compiled ({exc})"
    return None


def check(document: dict[str, Any]) -> None:
    """InvalidRequest, saying where and why, when `document` is not a valid JSON Schema."""
    found = problem(document)
    if found is not None:
        at, why = found
        raise errors.InvalidRequest(f"The JSON schema is not a valid JSON Schema{at}: {why}.")
