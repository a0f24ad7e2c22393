"""Manifests in and out: YAML/JSON text to validated resources, and back to dicts.

Loading has three steps so each caller takes what it needs: `parse_documents` (or
`load_path`) turns text into located mappings, `parse_objects` validates them into
resources, `check_references` checks the names they use; `validate_objects` does the
last two and reports their errors together. A bad batch is rejected whole: every step
collects every error before raising `errors.ManifestInvalid`, each located as
`Lane/x: spec.replicas` (camelCase, as written in the YAML) or, before a kind and
name are known, by document as `fleet.yaml#2: kind`.

`to_dict` / `from_dict` are the one serialisation of resources, used by the store and
on the wire (objects travel as JSON).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from blazar.api import kinds
from blazar.api.errors import FieldError, ManifestInvalid
from blazar.api.kinds import Kind, Resource
from blazar.api.meta import API_VERSION

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")

# Written by the store, never by users; dropped on input so that re-applying the
# output of `get -o yaml` works and cannot forge them. Both spellings, because
# populate_by_name also accepts the Python names.
_SERVER_METADATA = (
    "uid",
    "generation",
    "resourceVersion",
    "resource_version",
    "creationTimestamp",
    "creation_timestamp",
)

_ADAPTER: pydantic.TypeAdapter[Resource] = pydantic.TypeAdapter(Resource)


def parse_documents(text: str, *, source: str) -> list[tuple[str, dict[str, Any]]]:
    """Split multi-document YAML (JSON is YAML too) into (location, mapping) pairs.

    Locations are `source#n`, n counting documents from 1 as written, empty ones
    included, so the number matches what the user sees between `---` lines.
    """
    docs: list[tuple[str, dict[str, Any]]] = []
    problems: list[FieldError] = []
    index = 0
    try:
        for index, doc in enumerate(yaml.safe_load_all(text), start=1):
            location = f"{source}#{index}"
            if doc is None:
                continue
            if not isinstance(doc, dict):
                problems.append(
                    FieldError(
                        location,
                        f"expected a mapping with apiVersion, kind, metadata and spec, "
                        f"got {_yaml_type(doc)}",
                    )
                )
                continue
            docs.append((location, doc))
    except yaml.YAMLError as exc:
        problems.append(FieldError(f"{source}#{index + 1}", _yaml_message(exc)))
    if problems:
        raise ManifestInvalid(problems)
    return docs


def load_stream(text: str, source: str = "-") -> list[tuple[str, dict[str, Any]]]:
    return parse_documents(text, source=source)


def load_path(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Read one manifest file, or every manifest under a directory (recursively,
    in sorted order, skipping hidden files and directories such as `.git`)."""
    if path.is_dir():
        files = manifest_files(path)
    elif path.exists():
        files = [path]
    else:
        raise ManifestInvalid([FieldError(str(path), "no such file or directory")])
    docs: list[tuple[str, dict[str, Any]]] = []
    problems: list[FieldError] = []
    for file in files:
        try:
            docs += parse_documents(file.read_text(encoding="utf-8"), source=str(file))
        except ManifestInvalid as exc:
            problems += exc.errors
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(FieldError(str(file), f"cannot read: {exc}"))
    if problems:
        raise ManifestInvalid(problems)
    return docs


def manifest_files(directory: Path) -> list[Path]:
    """The manifest files under `directory`, recursively, sorted, hidden ones (and
    those under hidden directories such as `.git`) left out."""
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.suffix in MANIFEST_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def parse_objects(docs: Sequence[tuple[str, dict[str, Any]]]) -> list[Resource]:
    """Validate user-written documents into resources, or raise `ManifestInvalid`
    with every error of every document. `status` and server-set metadata in the
    input are dropped: users write spec, the daemon writes the rest."""
    objects, _, problems, _ = _parse(docs)
    if problems:
        raise ManifestInvalid(problems)
    return objects


def check_references(
    objects: Sequence[Resource], *, exists: Callable[[Kind, str], bool]
) -> list[FieldError]:
    """Every reference that names neither an object in `objects` nor one `exists`."""
    return _missing_references(objects, {kinds.key(o) for o in objects}, exists)


def validate_objects(
    docs: Sequence[tuple[str, dict[str, Any]]], *, exists: Callable[[Kind, str], bool]
) -> list[Resource]:
    """`parse_objects` then `check_references`, reporting the errors of both at once,
    as `apply` does: the user fixes the whole batch in one round.

    A reference to an object of the batch that failed validation is not reported:
    the object's own errors already say what is wrong.
    """
    objects, declared, problems, broken = _parse(docs)
    problems += _missing_references(objects, declared, exists)
    for prefix, doc, kind in broken:
        for path, target, name in _raw_references(kind, doc):
            if (target, name) not in declared and not exists(target, name):
                problems.append(FieldError(f"{prefix}: {path}", f'{target} "{name}" not found'))
    if problems:
        raise ManifestInvalid(problems)
    return objects


def locate(
    problems: Sequence[FieldError], docs: Sequence[tuple[str, dict[str, Any]]]
) -> list[FieldError]:
    """`problems` with the document each named object came from: `Lane/x: spec.replicas`
    becomes `Lane/x (fleet/lanes.yaml#2): spec.replicas`, for a reader who must find the
    file (an event of the watched directory). Errors located by document already are
    left as they are."""
    where: dict[str, str] = {}
    for location, raw in docs:
        metadata = raw.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        if isinstance(raw.get("kind"), str) and isinstance(name, str):
            where.setdefault(f"{raw['kind']}/{name}", location)
    located = []
    for problem in problems:
        prefix, sep, rest = problem.path.partition(": ")
        if sep and prefix in where:
            problem = FieldError(f"{prefix} ({where[prefix]}): {rest}", problem.message)
        located.append(problem)
    return located


def to_dict(resource: Resource) -> dict[str, Any]:
    data: dict[str, Any] = resource.model_dump(mode="json", by_alias=True, exclude_none=True)
    return data


def from_dict(data: dict[str, Any]) -> Resource:
    """Rebuild a resource from trusted data (the store, the wire), status and server
    metadata included."""
    return _ADAPTER.validate_python(data, context={kinds.STORED: True})


# --- helpers ---------------------------------------------------------------------


_Broken = tuple[str, dict[str, Any], Kind]  # (error prefix, document, kind)

_RAW_REFERENCES: dict[Kind, tuple[tuple[str, Kind], ...]] = {
    Kind.LANE: (
        ("spec.model", Kind.MODEL),
        ("spec.sloPolicy", Kind.SLO_POLICY),
        ("spec.speculation", Kind.SPEC_PAIR),
    ),
    Kind.SPEC_PAIR: (("spec.target", Kind.MODEL), ("spec.draft.model", Kind.MODEL)),
}


def _raw_references(kind: Kind, doc: dict[str, Any]) -> list[tuple[str, Kind, str]]:
    """References read straight from a document that failed validation, so that a
    broken Lane still reports its missing Model in the same round."""
    refs = []
    spec = doc.get("spec")
    if kind == Kind.LANE and isinstance(spec, dict) and spec.get("engine") == "upstream":
        return []
    for path, target in _RAW_REFERENCES.get(kind, ()):
        value: Any = doc
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str) and value:
            refs.append((path, target, value))
    return refs


def _parse(
    docs: Sequence[tuple[str, dict[str, Any]]],
) -> tuple[list[Resource], set[tuple[Kind, str]], list[FieldError], list[_Broken]]:
    """Valid objects, every (kind, name) the documents declare, the errors, and the
    documents that failed validation (their references are still worth checking)."""
    objects: list[Resource] = []
    broken: list[_Broken] = []
    declared: set[tuple[Kind, str]] = set()
    problems: list[FieldError] = []
    seen: dict[tuple[Kind, str], str] = {}
    for location, raw in docs:
        doc = _user_part(raw)
        kind = _check_header(doc, location, problems)
        if kind is None:
            continue
        metadata = doc.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        prefix = location
        if isinstance(name, str) and name:
            prefix = f"{kind}/{name}"
            declared.add((kind, name))
        try:
            obj = kinds.KIND_CLASSES[kind].model_validate(doc)
        except pydantic.ValidationError as exc:
            problems += _field_errors(exc, doc, prefix)
            broken.append((prefix, doc, kind))
            continue
        first = seen.setdefault(kinds.key(obj), location)
        if first != location:
            problems.append(
                FieldError(
                    f"{prefix}: metadata.name", f"duplicate {kind} (first defined in {first})"
                )
            )
            continue
        objects.append(obj)
    return objects, declared, problems, broken


def _missing_references(
    objects: Sequence[Resource],
    known: set[tuple[Kind, str]],
    exists: Callable[[Kind, str], bool],
) -> list[FieldError]:
    problems: list[FieldError] = []
    for obj in objects:
        for field, kind, name in kinds.references(obj):
            if (kind, name) not in known and not exists(kind, name):
                problems.append(
                    FieldError(
                        f"{obj.kind}/{obj.metadata.name}: {field}", f'{kind} "{name}" not found'
                    )
                )
    return problems


def _user_part(raw: dict[str, Any]) -> dict[str, Any]:
    doc = {k: v for k, v in raw.items() if k != "status"}
    if isinstance(doc.get("metadata"), dict):
        doc["metadata"] = {k: v for k, v in doc["metadata"].items() if k not in _SERVER_METADATA}
    return doc


def _check_header(doc: dict[str, Any], location: str, problems: list[FieldError]) -> Kind | None:
    """Check apiVersion and kind, the two fields that decide how to read the rest."""
    ok = True
    api_version = doc.get("apiVersion")
    if api_version is None:
        problems.append(FieldError(f"{location}: apiVersion", "Field required"))
        ok = False
    elif api_version != API_VERSION:
        problems.append(
            FieldError(
                f"{location}: apiVersion",
                f'unsupported apiVersion "{api_version}"; expected "{API_VERSION}"',
            )
        )
        ok = False
    kind_text = doc.get("kind")
    valid = ", ".join(k.value for k in Kind)
    if kind_text is None:
        problems.append(FieldError(f"{location}: kind", f"Field required (one of {valid})"))
        return None
    if kind_text not in [k.value for k in Kind]:
        problems.append(
            FieldError(f"{location}: kind", f'unknown kind "{kind_text}"; expected one of {valid}')
        )
        return None
    return Kind(kind_text) if ok else None


def _field_errors(
    exc: pydantic.ValidationError, doc: dict[str, Any], prefix: str
) -> list[FieldError]:
    return [
        FieldError(f"{prefix}: {_dotted(err['loc'], doc)}", err["msg"])
        for err in exc.errors(include_url=False)
    ]


def _dotted(loc: tuple[int | str, ...], doc: Any) -> str:
    """`('spec', 'tenants', 0, 'weight')` -> `spec.tenants[0].weight`.

    Pydantic puts the tag of a discriminated union into the location (`spec.draft.
    ngram.ngramSize`); the input shows which segments those are: a segment equal to
    the `kind` of the mapping it would index is the tag, not a field.
    """
    out = ""
    current: Any = doc
    for i, segment in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(segment, int):
            out += f"[{segment}]"
            current = (
                current[segment] if isinstance(current, list) and segment < len(current) else None
            )
            continue
        if not last and isinstance(current, dict) and current.get("kind") == segment:
            continue
        out += f".{segment}" if out else segment
        current = current.get(segment) if isinstance(current, dict) else None
    return out


def _yaml_type(value: object) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def _yaml_message(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return f"invalid YAML: {problem}"
