"""`apply -f` and `delete -f` read every file given, as kubectl does with `-f` repeated."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml

from blazar._proto.v1 import control_pb2
from blazar.api import errors
from blazar.cli import client, main
from blazar.rpc import status as rpc_status
from tests.rpc_errors import FakeRpcError

MODEL = """\
apiVersion: blazar.dev/v1alpha1
kind: Model
metadata: {name: m}
spec: {source: {path: /m.gguf}}
"""
LANE = """\
apiVersion: blazar.dev/v1alpha1
kind: Lane
metadata: {name: l}
spec: {model: m}
"""


class FakeControl:
    """The CLI's `ControlClient`, standing in for the daemon: records what it is sent."""

    def __init__(self) -> None:
        self.applied: list[control_pb2.ApplyRequest] = []
        self.deleted: list[tuple[str, str]] = []
        self.got: list[tuple[str, str]] = []
        self.asked_events: list[tuple[str, str, int]] = []
        self.missing: set[tuple[str, str]] = set()
        self.listed = "ab"  # the names `list` answers, one a letter

    def __enter__(self) -> FakeControl:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def apply(self, request: control_pb2.ApplyRequest) -> control_pb2.ApplyResponse:
        self.applied.append(request)
        results = []
        for text in request.objects_json:
            obj = json.loads(text)
            results.append(
                control_pb2.ApplyResult(
                    kind=obj["kind"], name=obj["metadata"]["name"], action="created"
                )
            )
        return control_pb2.ApplyResponse(results=results)

    def list(self, request: control_pb2.ListRequest) -> control_pb2.ListResponse:
        objects = [json.dumps({"kind": request.kind, "metadata": {"name": n}}) for n in self.listed]
        return control_pb2.ListResponse(objects_json=objects)

    def get(self, request: control_pb2.GetRequest) -> control_pb2.GetResponse:
        self.got.append((request.kind, request.name))
        if (request.kind, request.name) in self.missing:
            raise FakeRpcError(errors.ObjectNotFound(f'{request.kind} "{request.name}" not found.'))
        obj = {"kind": request.kind, "metadata": {"name": request.name}}
        return control_pb2.GetResponse(object_json=json.dumps(obj))

    def events(self, request: control_pb2.EventsRequest) -> control_pb2.EventsResponse:
        self.asked_events.append((request.kind, request.name, request.limit))
        return control_pb2.EventsResponse()

    def top(self, request: control_pb2.TopRequest) -> control_pb2.TopResponse:
        return control_pb2.TopResponse()

    def delete(self, request: control_pb2.DeleteRequest) -> control_pb2.DeleteResponse:
        if (request.kind, request.name) in self.missing:
            raise FakeRpcError(errors.ObjectNotFound(f'{request.kind} "{request.name}" not found.'))
        self.deleted.append((request.kind, request.name))
        return control_pb2.DeleteResponse()


@pytest.fixture
def control(monkeypatch: pytest.MonkeyPatch) -> FakeControl:
    fake = FakeControl()
    monkeypatch.setattr(client, "from_args", lambda args: fake)
    return fake


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "lane.yaml").write_text(LANE)
    return tmp_path / "model.yaml", tmp_path / "lane.yaml"


def test_apply_sends_every_file_in_one_batch(
    control: FakeControl, files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, lane = files
    assert main.main(["apply", "-f", str(model), "-f", str(lane)]) == 0
    [request] = control.applied
    assert [json.loads(o)["kind"] for o in request.objects_json] == ["Model", "Lane"]
    assert capsys.readouterr().out.splitlines() == ["model/m created", "lane/l created"]


def test_apply_with_stdin_among_the_files(
    control: FakeControl, files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", stdin(LANE.encode()))
    assert main.main(["apply", "-f", str(files[0]), "-f", "-"]) == 0
    [request] = control.applied
    assert [json.loads(o)["kind"] for o in request.objects_json] == ["Model", "Lane"]


def stdin(data: bytes, encoding: str = "utf-8") -> io.TextIOWrapper:
    """Standard input holding `data`, read in the locale's `encoding`."""
    return io.TextIOWrapper(io.BytesIO(data), encoding=encoding)


def test_stdin_is_read_as_utf8_as_files_are(
    control: FakeControl,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A manifest piped in is read as the same file given by name, whatever the
    locale's encoding; bytes that are not UTF-8 are the same error as in a file."""
    text = LANE.replace("metadata: {name: l}", "metadata: {name: l, annotations: {n: café “q”}}")
    monkeypatch.setattr("sys.stdin", stdin(text.encode(), encoding="latin-1"))
    assert main.main(["apply", "-f", "-"]) == 0
    [request] = control.applied
    assert json.loads(request.objects_json[0])["metadata"]["annotations"] == {"n": "café “q”"}
    bad = LANE.encode().replace(b"name: l", b"name: l\xff")
    monkeypatch.setattr("sys.stdin", stdin(bad))
    assert main.main(["apply", "-f", "-"]) == 1
    (tmp_path / "bad.yaml").write_bytes(bad)
    assert main.main(["apply", "-f", str(tmp_path / "bad.yaml")]) == 1
    from_stdin, from_file = capsys.readouterr().err.split("error: ")[1:]
    assert from_stdin == from_file.replace(str(tmp_path / "bad.yaml"), "<stdin>")
    assert "cannot read: 'utf-8' codec can't decode byte 0xff" in from_stdin
    assert len(control.applied) == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-f", "/no/such/file.yaml"], "the path '/no/such/file.yaml' does not exist"),
        (["-f", "-", "-f", "-"], "standard input"),
    ],
)
def test_a_bad_file_among_several_applies_nothing(
    control: FakeControl,
    files: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    assert main.main(["apply", "-f", str(files[0]), *extra]) == 1
    assert message in capsys.readouterr().err
    assert control.applied == []


@pytest.mark.parametrize("command", ["apply", "diff"])
def test_a_batch_too_large_is_worded_for_manifests(
    command: str,
    control: FakeControl,
    files: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The daemon's size refusal asks for a shorter prompt; `apply` has none to shorten."""

    def too_large(request: control_pb2.ApplyRequest) -> control_pb2.ApplyResponse:
        raise FakeRpcError(rpc_status.request_too_large(5_000_000, limit=4 * 2**20))

    monkeypatch.setattr(control, "apply", too_large)
    assert main.main([command, "-f", str(files[0])]) == (1 if command == "apply" else 2)
    err = capsys.readouterr().err
    assert err.startswith(
        "Error from server (RequestTooLarge): The batch of manifests is larger than the "
        "server accepts: 5000000 bytes, and the limit is 4194304 bytes (4 MiB)."
    )
    assert "prompt" not in err
    assert "smaller batches" in err


def test_delete_reads_every_file(control: FakeControl, files: tuple[Path, Path]) -> None:
    model, lane = files
    # The same object twice is deleted once (not reported as gone the second time).
    assert main.main(["delete", "-f", str(lane), "-f", str(model), "-f", str(lane)]) == 0
    assert control.deleted == [("Lane", "l"), ("Model", "m")]


def test_delete_reads_only_kind_and_name(
    control: FakeControl, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `kubectl delete -f`: a file whose spec no longer validates (here a Lane
    spilling over to itself, refused at apply since) still deletes what it names; a
    document that names no object is an error naming its place, and deletes nothing."""
    stale = tmp_path / "stale.yaml"
    stale.write_text(LANE.replace("spec: {model: m}", "spec: {model: m, spillover: l, slots: -3}"))
    assert main.main(["delete", "-f", str(stale)]) == 0
    assert control.deleted == [("Lane", "l")]
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text("apiVersion: blazar.dev/v1alpha1\nkind: Lane\nspec: {}\n")
    assert main.main(["delete", "-f", str(stale), "-f", str(nameless)]) == 1
    assert "nameless.yaml#1: metadata.name: Field required" in capsys.readouterr().err
    assert control.deleted == [("Lane", "l")]
    # A name with no UTF-8 form (an unpaired surrogate) could never have been stored.
    unpaired = tmp_path / "unpaired.yaml"
    unpaired.write_text(LANE.replace("name: l", 'name: "\\ud800"'))
    assert main.main(["delete", "-f", str(unpaired)]) == 1
    assert "unpaired.yaml#1: metadata.name: is not valid Unicode" in capsys.readouterr().err
    assert control.deleted == [("Lane", "l")]


def test_delete_says_a_name_that_is_no_string_is_not_one(
    control: FakeControl, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """YAML reads `name: 2024` as a number: the name is there, and not a string. It is
    said so, as `apply -f` says it, not "Field required" for a field that is written."""
    numbered = tmp_path / "numbered.yaml"
    numbered.write_text(LANE.replace("name: l", "name: 2024"))
    assert main.main(["delete", "-f", str(numbered)]) == 1
    err = capsys.readouterr().err
    assert "numbered.yaml#1: metadata.name: Input should be a valid string" in err
    assert "Field required" not in err
    assert control.deleted == []


def test_delete_takes_several_names(
    control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`delete lane a b`, as kubectl; a name given twice is deleted once."""
    control.missing.add(("Lane", "b"))
    assert main.main(["delete", "lane", "a", "b", "c", "a"]) == 1
    assert control.deleted == [("Lane", "a"), ("Lane", "c")]
    out = capsys.readouterr()
    assert out.out.splitlines() == ["lane/a deleted", "lane/c deleted"]
    assert 'Lane "b" not found' in out.err


def test_get_o_name_prints_what_delete_takes(
    control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """kubectl's `-o name`: KIND/NAME a line, which `delete` takes back."""
    assert main.main(["get", "lanes", "-o", "name"]) == 0
    names = capsys.readouterr().out.split()
    assert names == ["lane/a", "lane/b"]
    assert main.main(["delete", *names, "lane/a"]) == 0
    assert control.deleted == [("Lane", "a"), ("Lane", "b")]
    assert main.main(["delete", "lane/c", "d"]) == 1
    assert "delete takes KIND/NAME (such as lane/gemma3), not 'd'" in capsys.readouterr().err
    assert control.deleted == [("Lane", "a"), ("Lane", "b")]


def test_get_takes_kind_slash_name_as_delete_does(
    control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`get lane/a` (what `get -o name` prints, as kubectl takes it) is `get lane a`."""
    assert main.main(["get", "lane/a", "-o", "name"]) == 0
    assert main.main(["get", "SP/b", "-o", "json"]) == 0
    assert control.got == [("Lane", "a"), ("SpecPair", "b")]
    out = capsys.readouterr().out
    assert out.startswith("lane/a\n")
    assert json.loads(out.split("\n", 1)[1])["metadata"]["name"] == "b"
    assert main.main(["get", "lane/a", "b"]) == 1
    assert "get takes KIND NAME or KIND/NAME, not both" in capsys.readouterr().err
    assert main.main(["describe", "lane/"]) == 1
    assert "describe takes KIND/NAME (such as lane/gemma3), not 'lane/'" in (
        capsys.readouterr().err
    )
    assert control.got == [("Lane", "a"), ("SpecPair", "b")]


def test_events_filter_by_what_their_object_column_shows(
    control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`events` lists `Manifest/blazar-cli` (a rejected apply), `AuthFile/...`; the
    filters take those as they take objects' kinds, and KIND/NAME as `--for` does."""
    assert main.main(["events", "--for", "Manifest/blazar-cli"]) == 0
    assert main.main(["events", "authfile"]) == 0
    assert main.main(["events", "lanes", "a"]) == 0
    assert main.main(["events", "lane/a", "--limit", "5"]) == 0
    assert control.asked_events == [
        ("Manifest", "blazar-cli", 200),
        ("AuthFile", "", 200),
        ("Lane", "a", 200),
        ("Lane", "a", 5),
    ]
    capsys.readouterr()
    assert main.main(["events", "pod"]) == 1
    err = capsys.readouterr().err
    assert 'unknown kind "pod"' in err
    assert "events are also kept for Manifest, AuthFile, Store" in err
    assert len(control.asked_events) == 4


@pytest.mark.parametrize("argv", [["events", "lane", ""], ["events", ""]])
def test_events_refuse_an_empty_kind_or_name(
    argv: list[str], control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`events lane "$LANE"` with the variable unset listed every Lane's events."""
    assert main.main(argv) == 1
    assert "may not be empty" in capsys.readouterr().err
    assert control.asked_events == []


@pytest.mark.parametrize(
    ("argv", "said"), [(["events"], "No events.\n"), (["top"], "No Lane resources found.\n")]
)
def test_nothing_to_list_is_said_on_stderr(
    argv: list[str], said: str, control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `get` (and kubectl) say it: `blazar events | wc -l` counts events, not the
    sentence saying there are none."""
    assert main.main(argv) == 0
    assert capsys.readouterr() == ("", said)


@pytest.mark.parametrize("limit", ["0", "-1", "x"])
def test_events_limit_is_a_count_of_at_least_one(
    limit: str, control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--limit -1` printed "No events." and `--limit 0` the default 200: an error."""
    with pytest.raises(SystemExit) as exited:
        main.main(["events", "--limit", limit])
    assert exited.value.code == 2
    assert "argument --limit" in capsys.readouterr().err
    assert control.asked_events == []


def test_delete_goes_on_past_an_object_already_gone(
    control: FakeControl, files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """As `kubectl delete -f`: an object that is already gone is reported, the others in
    the files are still deleted, and the command ends with 1. Stopping at the first one
    would leave the rest running, depending only on their order in the file."""
    model, lane = files
    control.missing.add(("Model", "m"))
    assert main.main(["delete", "-f", str(model), "-f", str(lane)]) == 1
    assert control.deleted == [("Lane", "l")]
    out = capsys.readouterr()
    assert out.out.splitlines() == ["lane/l deleted"]
    assert out.err == 'Error from server (NotFound): Model "m" not found.\n'


@pytest.mark.parametrize("text", ["", "---\n", "# nothing yet\n---\n---\n# still nothing\n"])
@pytest.mark.parametrize(("command", "status"), [("apply", 1), ("delete", 1), ("diff", 2)])
def test_a_file_of_no_objects_is_an_error_not_a_silent_success(
    control: FakeControl,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    command: str,
    status: int,
) -> None:
    """`diff` too: with nothing to compare it would say "no changes" (0); its errors
    end with 2, since 1 means changes."""
    (tmp_path / "empty.yaml").write_text(text)
    assert main.main([command, "-f", str(tmp_path / "empty.yaml")]) == status
    assert capsys.readouterr().err == (
        f"error: no objects passed to {command}: '{tmp_path / 'empty.yaml'}' holds no objects\n"
    )
    assert (control.applied, control.deleted) == ([], [])


def test_files_of_no_objects_are_named_together(
    control: FakeControl, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.yaml").write_text("---\n")
    (tmp_path / "b").mkdir()
    assert main.main(["apply", "-f", str(tmp_path / "a.yaml"), "-f", str(tmp_path / "b")]) == 1
    assert f"'{tmp_path / 'a.yaml'}', '{tmp_path / 'b'}' hold no objects" in capsys.readouterr().err
    assert control.applied == []


def test_an_object_s_errors_name_its_file(
    control: FakeControl,
    files: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With several files given, `Lane/l: spec.replicas` alone leaves the reader to
    search them: each object's errors say the file and document it was read from."""
    model, lane = files
    refused = errors.ManifestInvalid(
        [
            errors.FieldError("Lane/l: spec.replicas", "Input should be a valid integer"),
            errors.FieldError("Lane/l: spec.colour", "Extra inputs are not permitted"),
            errors.FieldError("Lane/other: spec.model", 'Model "m" not found'),
            errors.FieldError("object#1: kind", "Field required"),
        ]
    )

    def refuse(request: control_pb2.ApplyRequest) -> control_pb2.ApplyResponse:
        raise FakeRpcError(refused)

    monkeypatch.setattr(control, "apply", refuse)
    assert main.main(["apply", "-f", str(model), "-f", str(lane)]) == 1
    assert capsys.readouterr().err == (
        "Error from server (InvalidManifest): 4 error(s) in manifest:\n"
        f"Lane/l ({lane}#1): spec.replicas: Input should be a valid integer\n"
        f"Lane/l ({lane}#1): spec.colour: Extra inputs are not permitted\n"
        # Not one the files hold: as the daemon said it.
        'Lane/other: spec.model: Model "m" not found\n'
        f"{model}#1: kind: Field required\n"
    )


def test_a_manifest_error_names_the_file_not_the_place_in_the_batch(
    control: FakeControl,
    files: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The daemon numbers the batch's documents across every file (object#3 is the
    second file's first here); the CLI names the file and document it read."""
    model, lane = files
    model.write_text(MODEL + "---\n" + LANE)
    refused = errors.ManifestInvalid(
        [
            errors.FieldError(
                "Lane/l (object#3): metadata.name", "duplicate Lane (first defined in object#2)"
            )
        ]
    )

    def refuse(request: control_pb2.ApplyRequest) -> control_pb2.ApplyResponse:
        raise FakeRpcError(refused)

    monkeypatch.setattr(control, "apply", refuse)
    for verb, status in (("apply", 1), ("diff", 2)):
        assert main.main([verb, "-f", str(model), "-f", str(lane)]) == status
        assert capsys.readouterr().err == (
            "Error from server (InvalidManifest): 1 error(s) in manifest:\n"
            f"Lane/l ({lane}#1): metadata.name: duplicate Lane (first defined in {model}#2)\n"
        )


@pytest.mark.parametrize(
    ("flag", "dry_run"),
    [
        ("--dry-run", True),
        ("--dry-run=server", True),
        ("--dry-run=client", True),
        ("--dry-run=none", False),
    ],
)
def test_dry_run_takes_the_values_kubectl_users_type(
    flag: str, dry_run: bool, control: FakeControl, files: tuple[Path, Path]
) -> None:
    """`--dry-run=client` and `=server` are what kubectl asks for (its bare `--dry-run`
    is deprecated); argparse refused them as "ignored explicit argument"."""
    assert main.main(["apply", "-f", str(files[0]), flag]) == 0
    [request] = control.applied
    assert request.dry_run is dry_run


def test_dry_run_refuses_a_value_kubectl_does_not_take(
    control: FakeControl, files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main.main(["apply", "-f", str(files[0]), "--dry-run=yes"])
    assert exited.value.code == 2
    assert "expected none, client or server, not 'yes'" in capsys.readouterr().err
    assert control.applied == []


@pytest.mark.parametrize("argv", [["describe", "lanes"], ["get", "lanes", "-o", "name"],
                                  ["get", "lanes"]])  # fmt: skip
def test_a_selector_that_matches_nothing_says_so_on_stderr_only(
    argv: list[str], control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`describe lanes -l x=y` printed a blank line on stdout and said nothing: a script
    reading stdout saw an empty object."""
    control.listed = ""
    assert main.main([*argv, "-l", "x=y"]) == 0
    assert capsys.readouterr() == ("", "No Lane resources found.\n")


@pytest.mark.parametrize("output", ["yaml", "json"])
def test_a_listing_is_a_list_in_yaml_as_in_json(
    output: str, control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """As kubectl prints one: a List, empty or not (`get -o yaml` wrote a stream of
    documents, and nothing at all for none); the object alone when named."""
    control.listed = ""
    assert main.main(["get", "lanes", "-l", "x=y", "-o", output]) == 0
    empty = yaml.safe_load(capsys.readouterr().out)
    assert empty == {"apiVersion": "v1", "kind": "List", "items": []}
    control.listed = "a"
    assert main.main(["get", "lanes", "-o", output]) == 0
    listed = yaml.safe_load(capsys.readouterr().out)
    assert listed["kind"] == "List" and [o["metadata"]["name"] for o in listed["items"]] == ["a"]
    assert main.main(["get", "lane", "a", "-o", output]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["metadata"]["name"] == "a"


def test_get_w_of_a_name_not_stored_is_not_found_not_a_silent_wait(
    control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`get lane nope -w` said "No Lane resources found." and waited for ever."""
    control.listed, control.missing = "", {("Lane", "nope")}
    assert main.main(["get", "lane", "nope", "-w"]) == 1
    assert capsys.readouterr() == ("", 'Error from server (NotFound): Lane "nope" not found.\n')


@pytest.mark.parametrize(
    "argv",
    [
        ["get", "lane", "a"],
        ["get", "lane/a"],
        ["get", "lane", "a", "-w"],
        ["describe", "lane", "a"],
    ],
)
def test_a_name_and_a_selector_together_are_refused_not_one_ignored(
    argv: list[str], control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`get lane a -l x=y` showed `a` whatever its labels: the selector was ignored."""
    assert main.main([*argv, "-l", "x=y"]) == 1
    verb = argv[0]
    assert capsys.readouterr() == (
        "",
        f"error: {verb} takes a NAME or -l SELECTOR, not both ('a' and 'x=y')\n",
    )
    assert control.got == []


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["events", "--limit", "2147483648"], "argument --limit: must be at most 2147483647"),
        (["logs", "lane/l", "--replica", "2147483648"], "argument --replica: must be at most"),
        (["logs", "lane/l", "--replica", "-1"], "argument --replica: must be at least 0, not -1"),
    ],
)
def test_a_number_beyond_its_int32_field_is_a_usage_error_not_a_traceback(
    argv: list[str], said: str, control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`events --limit 99999999999` and `logs --replica 99999999999` ended in a
    ValueError traceback from building the request."""
    with pytest.raises(SystemExit) as exited:
        main.main(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
    assert control.asked_events == []


@pytest.mark.parametrize("verb", ["get", "describe"])
def test_an_empty_name_is_refused_not_read_as_every_object(
    verb: str, control: FakeControl, capsys: pytest.CaptureFixture[str]
) -> None:
    """`get lane "$NAME"` with NAME unset listed every Lane."""
    assert main.main([verb, "lane", ""]) == 1
    assert capsys.readouterr() == ("", f"error: {verb}: a resource name may not be empty\n")


def test_an_argument_that_is_not_utf8_is_an_error_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`get lane $'\\xff'`: Python reads the byte as a lone surrogate, and encoding the
    request raised UnicodeEncodeError."""
    name = b"x\xff".decode("utf-8", "surrogateescape")
    # As the real client does: building the request encodes the name.
    monkeypatch.setattr(client, "from_args", lambda args: client.ControlClient("unix:/nowhere"))
    assert main.main(["get", "lane", name]) == 1
    assert capsys.readouterr() == ("", "error: b'x\\xff' is not UTF-8 text\n")
