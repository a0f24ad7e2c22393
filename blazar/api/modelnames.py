"""How a request's model name finds a Lane: its name or one of its aliases exactly,
else, for a name tagged `:latest`, the same name untagged. Ollama reads `gemma3` and
`gemma3:latest` as one model, and its users and clients add the tag (its own model
lists show it), so a Lane called `gemma3` answers to both. A Lane or alias whose name
carries the tag itself is found first, exactly."""

from __future__ import annotations

LATEST = ":latest"


def lookups(name: str) -> tuple[str, ...]:
    """The names tried for `name`, in order."""
    if name.endswith(LATEST) and len(name) > len(LATEST):
        return (name, name.removesuffix(LATEST))
    return (name,)
