"""Manifests in and out: YAML/JSON text to validated resources, and back to dicts.

Loading has three steps so each caller takes what it needs: `parse_documents` (or
`load_path`) turns text into located mappings, `parse_objects` validates them into
resources, `check_references` checks the names they use; `validate_objects` does the
last two and reports their errors together. A bad batch is rejected whole: every step
collects every error before raising `errors.ManifestInvalid`, each located as
`Lane/x: spec.replicas` (camelCase, as written in the YAML) or, before a kind and
name are known, by document as `fleet.yaml#2: kind`; a later document of a kind and
name already used, by both, as `Lane/x (fleet.yaml#2): metadata.name`.

`to_dict` / `from_dict` are the one serialisation of resources, used by the store and
on the wire (objects travel as JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pydantic
import yaml

from blazar.api import kinds
from blazar.api.errors import FieldError, ManifestInvalid
from blazar.api.kinds import Kind, Resource
from blazar.api.meta import API_VERSION, is_name

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

# An invalid name longer than this is not used to locate its document's errors.
_NAME_SHOWN_CHARS = 253

_ADAPTER: pydantic.TypeAdapter[Resource] = pydantic.TypeAdapter(Resource)


# The lines git leaves around a conflict it could not merge, in this order. Each is
# matched within its line: a pattern spanning the three would try every later position
# of a file whose conflict never ends (20 s for 160 kB with `.*` under re.S).
_CONFLICT_LINES = tuple(
    re.compile(rf"^{marker}(?:[ \t][^\r\n]*)?\r?$", re.M)
    for marker in ("<<<<<<<", "=======", ">>>>>>>")
)


def _conflict_line(text: str) -> int | None:
    """The line of the first `<<<<<<<` that a `=======` and then a `>>>>>>>` follow, or
    None. Looking from the first opening marker is enough: a later one has fewer lines
    after it. Linear in the text."""
    position, line = 0, None
    for marker in _CONFLICT_LINES:
        found = marker.search(text, position)
        if found is None:
            return None
        if line is None:
            line = text.count("\n", 0, found.start()) + 1
        position = found.end()
    return line


def parse_documents(text: str, *, source: str) -> list[tuple[str, dict[str, Any]]]:
    """Split multi-document YAML (JSON is YAML too) into (location, mapping) pairs.

    Locations are `source#n`, n counting documents from 1 as written, empty ones
    included, so the number matches what the user sees between `---` lines. A List
    (what `get -o json` prints for several objects, as kubectl's) stands for its items,
    located as `source#n.items[i]`.
    """
    if (line := _conflict_line(text)) is not None:
        # Said as what it is: YAML would name a line near it and a ':' it expected.
        raise ManifestInvalid(
            [
                FieldError(
                    source,
                    f"an unresolved merge conflict (git's <<<<<<< at line {line}): "
                    "resolve it and save the file again",
                )
            ]
        )
    docs: list[tuple[str, dict[str, Any]]] = []
    problems: list[FieldError] = []
    index = 0
    try:
        for index, doc in enumerate(yaml.load_all(text, Loader=_Loader), start=1):
            location = f"{source}#{index}"
            if doc is None:
                continue
            if (not_data := _not_data(doc)) is not None:
                problems.append(FieldError(location, not_data))
                continue
            if _is_list(doc):
                # kubectl's List, as `get -o json` prints a listing: its items, each
                # located by its place in the list.
                items = [(f"{location}.items[{i}]", item) for i, item in enumerate(doc["items"])]
            else:
                items = [(location, doc)]
            for where, item in items:
                if not isinstance(item, dict):
                    problems.append(
                        FieldError(
                            where,
                            f"expected a mapping with apiVersion, kind, metadata and spec, "
                            f"got {_yaml_type(item)}",
                        )
                    )
                    continue
                docs.append((where, item))
    except yaml.reader.ReaderError as exc:
        # Found before any document is read (PyYAML checks the whole text first): by
        # its line, not a document's number.
        problems.append(FieldError(source, _yaml_message(exc, text)))
    except yaml.YAMLError as exc:
        problems.append(FieldError(f"{source}#{index + 1}", _yaml_message(exc, text)))
    except RecursionError:
        # PyYAML composes a node per level of nesting by recursion.
        problems.append(FieldError(f"{source}#{index + 1}", "invalid YAML: nested too deeply"))
    except ValueError as exc:
        # An integer past CPython's 4,300-digit conversion limit, say.
        problems.append(FieldError(f"{source}#{index + 1}", f"invalid YAML: {exc}"))
    if problems:
        raise ManifestInvalid(problems)
    return docs


def _is_list(doc: Any) -> bool:
    """Whether a document is a List of objects (`kind: List`, `apiVersion: v1` or none,
    and `items`), as kubectl and `blazar get -o json` write a listing."""
    return (
        isinstance(doc, dict)
        and doc.get("kind") == "List"
        and doc.get("apiVersion", "v1") == "v1"
        and isinstance(doc.get("items"), list)
    )


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, except that an unquoted date stays the string it reads as
    (as Kubernetes reads it): a manifest is JSON data, which has no dates; and that a
    key given twice in one mapping is an error (as kubectl's strict decoding says),
    not the last value silently kept: `slots: 1` above `slots: 8` is a mistake that
    would otherwise apply whichever came second."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            # A merge key (`<<: *base`) may be overridden by the keys beside it, as YAML
            # says; only keys written in this mapping must be distinct.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    problem=(
                        f"key {json.dumps(key_node.value)} is given twice in one mapping (first at "
                        f"line {first[key].line + 1}); keep one"
                    ),
                    problem_mark=key_node.start_mark,
                )
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_MERGE_TAG = "tag:yaml.org,2002:merge"


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}

# Values a document may hold once its YAML aliases are expanded: what `blazar apply`
# sends and the daemon validates is the expanded document, and a few lines of aliases
# (each naming the one before several times) expand past any memory.
MAX_EXPANDED_VALUES = 100_000
_JSON_SCALARS = (str, int, float, bool, type(None))


def _not_data(doc: Any) -> str | None:
    """Why a loaded document cannot be sent as JSON, or None: a value JSON has no
    form for (`!!binary`, `!!set`, `!!timestamp`), an alias to a node that contains it
    (a cycle), or more than `MAX_EXPANDED_VALUES` values once aliases are expanded."""
    count = 0
    # Depth first, with the containers on the way to each node, to see a cycle.
    stack: list[tuple[Any, frozenset[int]]] = [(doc, frozenset())]
    while stack:
        node, above = stack.pop()
        count += 1
        if count > MAX_EXPANDED_VALUES:
            return (
                f"invalid YAML: more than {MAX_EXPANDED_VALUES:,} values once its aliases "
                "are expanded"
            )
        if isinstance(node, dict | list):
            if id(node) in above:
                return "invalid YAML: an alias refers to a node that contains it"
            inside = above | {id(node)}
            children = list(node.keys()) + list(node.values()) if isinstance(node, dict) else node
            stack.extend((child, inside) for child in children)
        elif not isinstance(node, _JSON_SCALARS):
            return (
                f"invalid YAML: a {type(node).__name__} value is not data a manifest can "
                "hold; quote it to make it a string"
            )
    return None


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
    those under hidden directories such as `.git`) left out. A symlink of a manifest's
    name that points nowhere is listed too: reading it fails, and that is told (left
    out, a watched directory would prune what the file held, silently)."""
    return sorted(
        p
        for p in directory.rglob("*")
        if (p.is_file() or (p.is_symlink() and not p.exists()))
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


def identities(docs: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[Kind, str]]:
    """The (kind, name) of each document, read from its header and `metadata.name`
    alone, as kubectl's delete reads them: a manifest that no longer validates (written
    under older rules, say) still names what it made. Raise `ManifestInvalid` for a
    document that names no object."""
    found: list[tuple[Kind, str]] = []
    problems: list[FieldError] = []
    for location, raw in docs:
        doc = _user_part(raw)
        kind = _check_header(doc, location, problems)
        if kind is None:
            continue
        metadata = doc.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        if name is not None and not isinstance(name, str):
            # Written, and read as another type (`name: 2024`): said as apply says it.
            problems.append(
                FieldError(f"{location}: metadata.name", "Input should be a valid string")
            )
        elif not name:
            problems.append(FieldError(f"{location}: metadata.name", "Field required"))
        elif _SURROGATE.search(name):
            # No such name can be stored, nor sent (it has no UTF-8 form).
            problems.append(FieldError(f"{location}: metadata.name", "is not valid Unicode"))
        else:
            found.append((kind, name))
    if problems:
        raise ManifestInvalid(problems)
    return found


def resource_versions(
    docs: Sequence[tuple[str, dict[str, Any]]],
) -> tuple[dict[tuple[Kind, str], int], list[FieldError]]:
    """The `metadata.resourceVersion` each document sets, by (kind, name), and the
    errors of those that are no version: an interactive apply takes them as
    preconditions (`Store.apply_all`). Absent, null, empty and 0 set none (last apply
    wins), as an empty one does in Kubernetes; a version is a whole number, as `get`
    prints it, or the same in a string, as Kubernetes prints it. A document without a
    valid kind and name is skipped: validation says what is wrong with it."""
    found: dict[tuple[Kind, str], int] = {}
    problems: list[FieldError] = []
    for _, raw in docs:
        metadata = raw.get("metadata")
        kind_text = raw.get("kind")
        if not isinstance(metadata, dict) or kind_text not in [k.value for k in Kind]:
            continue
        name = metadata.get("name")
        value = metadata.get("resourceVersion", metadata.get("resource_version"))
        if not isinstance(name, str) or not is_name(name) or value is None or value == "":
            continue
        if isinstance(value, str) and value.isascii() and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(
                FieldError(
                    f"{kind_text}/{name}: metadata.resourceVersion",
                    "must be the version `get` printed (a whole number), or be left out "
                    "for the apply to replace whatever is stored",
                )
            )
        elif value:
            found[(Kind(kind_text), name)] = value
    return found, problems


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


def locations(docs: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """`KIND/NAME` of each document that names an object -> where it was read (the
    first, for a name given twice)."""
    where: dict[str, str] = {}
    for location, raw in docs:
        metadata = raw.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        if isinstance(raw.get("kind"), str) and isinstance(name, str):
            where.setdefault(f"{raw['kind']}/{name}", location)
    return where


def locate(
    problems: Sequence[FieldError], docs: Sequence[tuple[str, dict[str, Any]]]
) -> list[FieldError]:
    """`problems` with the document each named object came from: `Lane/x: spec.replicas`
    becomes `Lane/x (fleet/lanes.yaml#2): spec.replicas`, for a reader who must find the
    file (an event of the watched directory). Errors located by document already are
    left as they are."""
    where = locations(docs)
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
        if (where := _unpaired_surrogate(doc)) is not None:
            # Before anything echoes a value: such a string has no UTF-8 form, so no
            # error message, event or stored row could hold it.
            problems.append(
                FieldError(
                    f"{location}: {where}",
                    "holds an unpaired surrogate, so it is not valid Unicode (a character "
                    "outside the BMP is written as a surrogate pair)",
                )
            )
            continue
        kind = _check_header(doc, location, problems)
        if kind is None:
            continue
        metadata = doc.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        prefix = location
        if isinstance(name, str) and name:
            if name.isprintable() and len(name) <= _NAME_SHOWN_CHARS:
                # Otherwise (line breaks, a page of text) the document's place names it,
                # and its name's error says why.
                prefix = f"{kind}/{name}"
                if (kind, name) in declared:
                    # A later document of the same name: `locate` would place its
                    # errors in the first one, so they carry their own place.
                    prefix = f"{prefix} ({location})"
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


_SURROGATE = re.compile("[\\ud800-\\udfff]")


def _unpaired_surrogate(doc: dict[str, Any]) -> str | None:
    """The path (`spec.aliases[0]`) of the first string, key or value, holding a
    surrogate, or None. JSON and YAML parsers join a valid pair into one character, so
    any surrogate left is unpaired. One pass without recursion; a key is shown with the
    surrogate escaped."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        node, path = stack.pop()
        entries = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in entries:
            if isinstance(key, str):
                shown = key.encode("utf-8", "backslashreplace").decode()
                here = f"{path}.{shown}" if path else shown
                if not key.isascii() and _SURROGATE.search(key):
                    return here
            else:
                here = f"{path}[{key}]"
            if isinstance(value, str):
                if not value.isascii() and _SURROGATE.search(value):
                    return here
            elif isinstance(value, dict | list):
                stack.append((value, here))
    return None


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
        # An empty key (an unknown field named "") would leave no path at all.
        name = segment or '""'
        out += f".{name}" if out else name
        current = current.get(segment) if isinstance(current, dict) else None
    return out


def _yaml_type(value: object) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def _yaml_message(exc: yaml.YAMLError, text: str) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        # A character YAML does not allow (a control character, a lone surrogate):
        # PyYAML's own text is two lines naming "<unicode string>" and an offset.
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return (
            f"invalid YAML at line {line}, column {column}: character U+{code:04X} is "
            "not allowed (write it as an escape in a double-quoted string)"
        )
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return f"invalid YAML: {problem}"
