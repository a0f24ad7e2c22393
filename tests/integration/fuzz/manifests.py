"""Valid manifests of every kind for the manifest fuzz run (`test_manifests.py`), the
YAML damage it also tries, and `hold`, which keeps an accepted Lane from starting an
engine.

Every fuzzed object is named from a handful of names per kind (`fz-...`), so that the
run reconfigures objects as often as it creates them and the store stays small. The
Models point at files that do not exist under the daemon's model root (or name a
package that no entry point registers, which is refused), so a Model the store accepts
never becomes ready, and a Lane that the store accepts waits for it, with no engine:
2,000 manifests start no process. A mutation cannot be trusted to keep that so (it
could name the served Model), which is what `hold` is for.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tests.integration.fuzz import serving
from tests.integration.fuzz.mutation import Raw

API = "blazar.dev/v1alpha1"
KINDS = ("Model", "Lane", "SLOPolicy", "SpecPair")
NAMES = {kind: [f"fz-{kind.lower()}-{i}" for i in range(3)] for kind in KINDS}

# Stored before the run, and never to be changed by it: the served Lane and Model, and
# one object of the two other kinds (`test_manifests.kept`).
KEPT_POLICY = "kept-policy"
KEPT_PAIR = "kept-pair"
PROTECTED = frozenset({serving.LANE, serving.MODEL, KEPT_POLICY, KEPT_PAIR})

SMALL = st.integers(-3, 70)
NAME_TEXT = st.text(min_size=1, max_size=12)
TEMPLATE = st.sampled_from(
    [
        "gemma",
        "chatml",
        "llama3",
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "{{ messages[0].content }}",
        "{% for m in messages %}{{ m.content | nope }}{% endfor %}",  # unknown filter
        "{% for %}",  # not Jinja
        "{{ x }}",  # never reads messages
        "plain text",
    ]
)


def _maybe(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def _object(kind: str, name: str, spec: dict[str, Any], **meta: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": kind, "metadata": {"name": name, **meta}, "spec": spec}


METADATA = _maybe(
    labels=st.dictionaries(st.sampled_from(["app", "tier", "x/y"]), NAME_TEXT, max_size=2),
    annotations=st.dictionaries(NAME_TEXT, NAME_TEXT, max_size=2),
)


@st.composite
def model(draw: st.DrawFn, home: str) -> dict[str, Any]:
    name = draw(st.sampled_from(NAMES["Model"]))
    source = draw(
        st.one_of(
            st.builds(lambda n: {"path": f"{home}/models/missing-{n}.gguf"}, st.integers(0, 3)),
            st.just({"package": "not-a-registered-model"}),
            st.just({"path": "/etc/passwd"}),  # outside the model roots
        )
    )
    spec: dict[str, Any] = {"source": source}
    spec |= draw(
        _maybe(
            sha256=st.sampled_from(["0" * 64, "A" * 64, "abc"]),
            chatTemplate=TEMPLATE,
            contextLength=st.integers(-1, 2**20),
        )
    )
    return _object("Model", name, spec, **draw(METADATA))


@st.composite
def lane(draw: st.DrawFn) -> dict[str, Any]:
    name = draw(st.sampled_from(NAMES["Lane"]))
    spec: dict[str, Any] = {"model": draw(st.sampled_from(NAMES["Model"]))}
    spec |= draw(
        _maybe(
            aliases=st.lists(NAME_TEXT, max_size=3),
            replicas=st.integers(0, 3),
            slots=SMALL,
            contextPerSlot=st.sampled_from([32, 64, 2048, 2**20, 2**20 + 1]),
            threads=SMALL,
            gpuLayers=st.sampled_from([0, 999, 9999, 10_000]),
            kvCache=_maybe(
                typeK=st.sampled_from(["f16", "q8_0", "q4_0", "nope"]),
                typeV=st.sampled_from(["f16", "q8_0", "q4_0", "nope"]),
                persist=st.booleans(),
                maxParkedMiB=st.integers(-1, 4096),
            ),
            flashAttention=st.sampled_from(["auto", "on", "off", "maybe"]),
            speculation=st.sampled_from(NAMES["SpecPair"]),
            sloPolicy=st.sampled_from(NAMES["SLOPolicy"]),
            idle=st.just({"sleepAfter": "5m"}),
            engine=st.sampled_from(["llama-cpp", "upstream"]),
        )
    )
    return _object("Lane", name, spec, **draw(METADATA))


@st.composite
def slo_policy(draw: st.DrawFn) -> dict[str, Any]:
    spec = draw(
        _maybe(
            priority=st.integers(-10, 10),
            ttftTargetMs=st.integers(-1, 10_000),
            tpotTargetMs=st.integers(0, 1000),
            maxQueueDepth=st.integers(-1, 1000),
            maxQueueWaitMs=st.integers(-1, 60_000),
            onOverload=st.sampled_from(["reject", "queue", "drop"]),
            tenants=st.lists(st.fixed_dictionaries({"name": NAME_TEXT}), max_size=2),
            rateLimit=st.just({"requestsPerMinute": 10}),
        )
    )
    return _object("SLOPolicy", draw(st.sampled_from(NAMES["SLOPolicy"])), spec, **draw(METADATA))


@st.composite
def spec_pair(draw: st.DrawFn) -> dict[str, Any]:
    draft = draw(
        st.one_of(
            _maybe(ngramSize=st.integers(0, 9), maxDraftTokens=st.integers(0, 33)).map(
                lambda d: {"kind": "ngram", **d}
            ),
            st.sampled_from(NAMES["Model"]).map(lambda m: {"kind": "model", "model": m}),
        )
    )
    spec: dict[str, Any] = {"target": draw(st.sampled_from(NAMES["Model"])), "draft": draft}
    spec |= draw(
        _maybe(disableAboveBatch=st.integers(0, 8), minAcceptanceRate=st.floats(-0.5, 1.5))
    )
    return _object("SpecPair", draw(st.sampled_from(NAMES["SpecPair"])), spec, **draw(METADATA))


def documents(home: str) -> st.SearchStrategy[dict[str, Any]]:
    """A valid manifest (as far as its own fields go: what it names may be missing)."""
    return st.one_of(model(home), lane(), slo_policy(), spec_pair())


def hold(doc: Any) -> None:
    """Keep a fuzzed document from touching what the run must leave alone: one named
    after a protected object is renamed, and a Lane that names the served Model runs
    no replica (it would start an engine)."""
    if not isinstance(doc, dict):
        return
    metadata = doc.get("metadata")
    if (
        isinstance(metadata, dict)
        and isinstance(metadata.get("name"), str)
        and metadata["name"] in PROTECTED
    ):
        metadata["name"] = "fz-renamed"
    spec = doc.get("spec")
    if isinstance(spec, dict) and spec.get("model") == serving.MODEL:
        spec["replicas"] = 0


# Texts that break YAML, put in place of a line or appended.
BROKEN_YAML = st.sampled_from(
    [
        "spec: [unclosed",
        "\tkind: Lane",  # a tab as indentation
        "  - a\n - b",
        "key: value: other",
        "? [a, b]\n: c",  # a key that is a list
        "a: &x [*x]",  # a self-referring alias
        "a: &a [1, 2]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b, *b, *b]",
        "!!python/object/apply:os.system ['true']",
        "%YAML 9.9\n---",
        "--- !<tag:yaml.org,2002:set> {a}",
        "...\n...",
        "x: !!binary 'AAAA'",
        "x: 2001-12-14t21:59:43.10-05:00",
        "x: .nan",
        "x: 0x_",
        "'unterminated",
        "\ufeffkind: Lane",
        "\x00",
        "\x85",
        "x: " + "[" * 3000 + "]" * 3000,  # deeper than PyYAML's recursive composer goes
        "x:" + "\n  - " * 50,
    ]
)


def raw_value(raw: Raw) -> tuple[bool, Any]:
    """What YAML can say for a `Raw` JSON value: (False, None) when it cannot (nesting
    deeper than the parser's recursion)."""
    import json

    try:
        return True, json.loads(raw.text)
    except (ValueError, RecursionError):
        return False, None
