"""Keys and tenants end to end (issue 19): a real daemon with an auth file, every HTTP
route of every dialect and every gRPC method, asked with no key, a wrong key, a key
without access to the Lane, a key with access and an admin key.

The fleet is the default one (Lane `gemma3`). Generations ask for one token: what the
model writes does not matter here, only who may ask.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
from starlette.routing import Route

from blazar._proto.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from blazar.api import tenants
from tests.integration.harness import REPO, Daemon, default_fleet, wait_for

pytestmark = pytest.mark.slow

LANE = "gemma3"
ORIGIN = "https://app.example"
KEYS = {name: tenants.new_key() for name in ("admin", "user", "outsider", "limited")}
WRONG = "bz-not-a-key-anyone-holds"


def auth_file(limited_rpm: int = 2) -> str:
    def digest(name: str) -> str:
        return json.dumps(tenants.digest(KEYS[name]))

    return textwrap.dedent(
        f"""\
        tenants:
          - name: admin
            keys: [{digest("admin")}]
            lanes: ["*"]
            admin: true
          - name: user
            keys: [{digest("user")}]
            lanes: [default]
            sloPolicies: [batch]
          - name: outsider
            keys: [{digest("outsider")}]
            lanes: [some-other-lane]
          - name: limited
            keys: [{digest("limited")}]
            lanes: ["*"]
            rateLimit: {{requestsPerMinute: {limited_rpm}}}
        """
    )


@pytest.fixture(scope="module")
def auth_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "auth.yaml"
    path.write_text(auth_file())
    return path


@pytest.fixture(scope="module")
def daemon(model_path: Path, auth_path: Path) -> Iterator[Daemon]:
    args = ["--auth-file", str(auth_path), "--allow-origin", ORIGIN]
    with default_fleet(serve_args=args) as d:
        yield d


# --- HTTP ------------------------------------------------------------------------

ONE = {"max_tokens": 1}
MESSAGES = [{"role": "user", "content": "Hi"}]
# (dialect, method, path, body): every route of every dialect that uses a model.
MODEL_ROUTES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("openai", "POST", "/v1/chat/completions", {"model": LANE, "messages": MESSAGES, **ONE}),
    ("openai", "POST", "/v1/completions", {"model": LANE, "prompt": "Hi", **ONE}),
    ("openai", "POST", "/v1/embeddings", {"model": LANE, "input": "Hi"}),
    ("openai", "POST", "/v1/responses", {"model": LANE, "input": "Hi", "max_output_tokens": 1}),
    ("anthropic", "POST", "/v1/messages", {"model": LANE, "messages": MESSAGES, **ONE}),
    ("anthropic", "POST", "/v1/messages/count_tokens", {"model": LANE, "messages": MESSAGES}),
    ("ollama", "POST", "/api/chat", {"model": LANE, "messages": MESSAGES, "stream": False,
                                     "options": {"num_predict": 1}}),
    ("ollama", "POST", "/api/generate", {"model": LANE, "prompt": "Hi", "stream": False,
                                         "options": {"num_predict": 1}}),
    ("ollama", "POST", "/api/embed", {"model": LANE, "input": "Hi"}),
    ("ollama", "POST", "/api/embeddings", {"model": LANE, "prompt": "Hi"}),
]  # fmt: skip
# Routes that list models: a tenant sees only its Lanes, so one without access gets
# the route's success with none of them (or not found, for one model by name).
LISTING_ROUTES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("openai", "GET", "/v1/models", None),
    ("openai", "GET", f"/v1/models/{LANE}", None),
    ("ollama", "GET", "/api/tags", None),
    ("ollama", "POST", "/api/show", {"model": LANE}),
    ("ollama", "GET", "/api/ps", None),
]
# Routes that need a key but make no model call of their own: stored responses by id,
# compaction and Ollama's management (which Blazar refuses), the token count.
OTHER_ROUTES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("openai", "POST", "/v1/responses/input_tokens", {"model": LANE, "input": "Hi"}),
    ("openai", "GET", "/v1/responses/resp_none", None),
    ("openai", "DELETE", "/v1/responses/resp_none", None),
    ("openai", "POST", "/v1/responses/resp_none/cancel", {}),
    ("openai", "GET", "/v1/responses/resp_none/input_items", None),
    ("openai", "POST", "/v1/responses/compact", {"model": LANE, "input": "Hi"}),
    ("ollama", "POST", "/api/pull", {"model": LANE}),
    ("ollama", "POST", "/api/push", {"model": LANE}),
    ("ollama", "POST", "/api/create", {"model": "copy", "from": LANE}),
    ("ollama", "POST", "/api/copy", {"source": LANE, "destination": "copy"}),
    ("ollama", "DELETE", "/api/delete", {"model": LANE}),
]
KEYED_ROUTES = MODEL_ROUTES + LISTING_ROUTES + OTHER_ROUTES
# The generation routes again, streamed: a refusal comes before the first chunk, with
# its status, in the dialect's envelope.
STREAMED_ROUTES = [
    (dialect, method, path, {**body, "stream": True})
    for dialect, method, path, body in MODEL_ROUTES
    if body is not None and path in {
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
        "/api/chat", "/api/generate",
    }
]  # fmt: skip
# Open without a key (`blazar.shim.keys.OPEN_PATHS`), GET and HEAD.
OPEN_ROUTES = ["/healthz", "/readyz", "/metrics", "/", "/api/version"]


def headers_for(dialect: str, key: str | None) -> dict[str, str]:
    if key is None:
        return {}
    if dialect == "anthropic":
        return {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return {"authorization": f"Bearer {key}"}


def assert_refusal(dialect: str, response: httpx.Response, status: int, kind: str) -> None:
    """The refusal in the dialect's own envelope; `kind` is what Anthropic calls it."""
    assert response.status_code == status, response.text
    body = response.json()
    if dialect == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["type"] == (
            "invalid_request_error" if status == 401 else "permission_error"
        )
        if status == 401:
            assert body["error"]["code"] == "invalid_api_key"
    elif dialect == "anthropic":
        assert body["type"] == "error", body
        assert body["error"]["type"] == kind
        assert response.headers["request-id"] == body["request_id"]
    else:
        assert set(body) == {"error"} and isinstance(body["error"], str), body


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{daemon.http}", timeout=60) as client:
        yield client


def call(
    http: httpx.Client, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str]
) -> httpx.Response:
    return http.request(method, path, json=body, headers=headers)


def test_the_matrix_covers_every_route_the_shim_mounts() -> None:
    """A new HTTP route must be put in the matrix (keyed) or in OPEN_ROUTES (and
    `keys.OPEN_PATHS`), so that whether it needs a key is decided, and tested."""
    from blazar.shim import keys
    from blazar.shim.app import create_app

    assert set(OPEN_ROUTES) == keys.OPEN_PATHS
    called = [(method, path) for _, method, path, _ in KEYED_ROUTES]
    called += [("GET", path) for path in OPEN_ROUTES]
    missing = []
    for route in create_app(inference_target="127.0.0.1:1").routes:
        assert isinstance(route, Route)
        for method in sorted((route.methods or set()) - {"HEAD"}):  # HEAD: with its GET
            if not any(m == method and route.path_regex.match(p) for m, p in called):
                missing.append(f"{method} {route.path}")
    assert not missing, missing


@pytest.mark.parametrize(("dialect", "method", "path", "body"), KEYED_ROUTES + STREAMED_ROUTES)
def test_http_routes_without_a_key_or_with_a_wrong_one_are_401(
    http: httpx.Client, dialect: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    for key in (None, WRONG):
        response = call(http, method, path, body, headers_for(dialect, key))
        assert_refusal(dialect, response, 401, "authentication_error")
        if method == "GET":
            head = http.head(path, headers=headers_for(dialect, key))
            assert head.status_code == 401, (head, head.headers)


@pytest.mark.parametrize(("dialect", "method", "path", "body"), OTHER_ROUTES)
def test_a_key_gets_past_the_check_on_routes_that_make_no_model_call(
    http: httpx.Client, dialect: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    """What these answer a caller with a key is their own (a token count, no such
    response, Ollama's management refused); not a 401."""
    response = call(http, method, path, body, headers_for(dialect, KEYS["user"]))
    assert response.status_code not in (401, 403, 500), response.text


def test_a_path_no_route_serves_is_401_without_a_key(http: httpx.Client) -> None:
    """Without a key the server does not say which paths it serves."""
    for dialect, path in (("openai", "/v1/no-such-route"), ("ollama", "/api/no-such-route")):
        assert_refusal(dialect, http.get(path), 401, "authentication_error")
        response = http.get(path, headers=headers_for(dialect, KEYS["user"]))
        assert response.status_code == 404, response.text


def without_ids(value: Any) -> Any:
    """A body with the ids each answer makes anew (Anthropic's `request_id`) left out."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k != "request_id"}
    return value


@pytest.mark.parametrize(("dialect", "method", "path", "body"), MODEL_ROUTES + STREAMED_ROUTES)
def test_a_lane_a_key_may_not_use_is_answered_as_a_model_that_does_not_exist(
    http: httpx.Client, dialect: str, method: str, path: str, body: dict[str, Any]
) -> None:
    """Else a tenant could probe which Lane names exist, which its model lists hide."""
    headers = headers_for(dialect, KEYS["outsider"])
    forbidden = call(http, method, path, body, headers)
    unknown = call(http, method, path, {**body, "model": "no-such-lane"}, headers)
    assert forbidden.status_code == unknown.status_code == 404, forbidden.text
    assert without_ids(forbidden.json()) == json.loads(
        json.dumps(without_ids(unknown.json())).replace("no-such-lane", LANE)
    )


@pytest.mark.parametrize(
    ("dialect", "method", "path", "body"), MODEL_ROUTES + STREAMED_ROUTES + LISTING_ROUTES
)
@pytest.mark.parametrize("tenant", ["user", "admin"])
def test_a_key_with_access_is_served(
    http: httpx.Client,
    tenant: str,
    dialect: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    response = call(http, method, path, body, headers_for(dialect, KEYS[tenant]))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("dialect", "method", "path", "body"), MODEL_ROUTES)
def test_a_tenant_names_only_the_slo_policies_it_lists(
    http: httpx.Client, dialect: str, method: str, path: str, body: dict[str, Any]
) -> None:
    """Naming a policy (`x-blazar-slo`) needs the tenant's `sloPolicies` to list it, on
    every route that takes a model; else a tenant could mark its work as another's
    priority. `admin` does not widen it. The Lane's own (`interactive`) needs nothing."""
    for tenant, policy, status in [
        ("user", "batch", 200),
        ("user", "interactive", 200),
        ("admin", "interactive", 200),
        ("admin", "batch", 403),
        ("user", "no-such-policy", 403),  # the same answer whether it exists or not
    ]:
        headers = {**headers_for(dialect, KEYS[tenant]), "x-blazar-slo": policy}
        response = call(http, method, path, body, headers)
        assert response.status_code == status, (tenant, policy, response.text)
        if status == 403:
            assert_refusal(dialect, response, 403, "permission_error")
            assert "sloPolicies" in response.text and f"'{policy}'" in response.text


def test_the_official_clients_see_a_policy_the_tenant_may_not_name_as_permission_denied(
    daemon: Daemon,
) -> None:
    slo = {"x-blazar-slo": "batch"}
    client = openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key=KEYS["admin"])
    with client, pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(
            model=LANE, messages=MESSAGES, max_tokens=1, extra_headers=slo
        )
    assert "sloPolicies" in str(refused.value)
    claude = anthropic.Anthropic(base_url=f"http://{daemon.http}", api_key=KEYS["admin"])
    with claude, pytest.raises(anthropic.PermissionDeniedError):
        claude.messages.create(model=LANE, messages=MESSAGES, max_tokens=1, extra_headers=slo)


def test_a_tenant_reuses_only_its_own_cached_prompts(http: httpx.Client) -> None:
    """The prefix cache is kept per tenant: a prompt another tenant sent is not reused
    (else its cached-token count, or its speed, tells a guess at another tenant's
    prompt right from wrong), and the tenant's own repeat is. The long prompt keeps a
    slot's cache worth keeping (`batching.MIN_KEEP_TOKENS`)."""
    prompt = "The secret of tenant admin is 4417. " * 40

    def cached(tenant: str) -> int:
        response = http.post(
            "/v1/completions",
            json={"model": LANE, "prompt": prompt, "max_tokens": 1},
            headers=headers_for("openai", KEYS[tenant]),
        )
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] > 200, usage
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    cached("admin")
    assert cached("admin") > 200  # the cache works: its owner reuses it
    assert cached("user") == 0  # another tenant does not
    assert cached("user") > 200  # its own, once it has sent it


def test_a_tenant_lists_only_the_lanes_it_may_use(http: httpx.Client) -> None:
    def listed(key: str) -> set[str]:
        response = http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return {m["id"] for m in response.json()["data"]}

    assert LANE in listed(KEYS["admin"])
    assert LANE in listed(KEYS["user"])  # it names the alias `default`: the whole Lane
    assert listed(KEYS["outsider"]) == set()
    for path, body in ((f"/v1/models/{LANE}", None), ("/api/show", {"model": LANE})):
        response = call(
            http, "POST" if body else "GET", path, body, headers_for("x", KEYS["outsider"])
        )
        assert response.status_code == 404, response.text
    tags = http.get("/api/tags", headers={"authorization": f"Bearer {KEYS['outsider']}"})
    assert tags.json() == {"models": []}


@pytest.mark.parametrize("path", OPEN_ROUTES)
def test_probes_metrics_and_version_need_no_key(http: httpx.Client, path: str) -> None:
    assert http.get(path).status_code == 200
    assert http.head(path).status_code == 200


# --- browsers --------------------------------------------------------------------


@pytest.mark.parametrize(("dialect", "method", "path", "body"), MODEL_ROUTES + LISTING_ROUTES)
def test_a_page_of_another_origin_is_refused_before_any_work(
    http: httpx.Client, dialect: str, method: str, path: str, body: dict[str, Any] | None
) -> None:
    """Even with a valid key (a page could hold one): the origin is not allowed."""
    headers = {**headers_for(dialect, KEYS["admin"]), "origin": "https://evil.example"}
    response = call(http, method, path, body, headers)
    assert_refusal(dialect, response, 403, "permission_error")
    assert "access-control-allow-origin" not in response.headers


def test_a_cross_origin_form_post_is_refused(http: httpx.Client) -> None:
    """What a page can send without a preflight: a form, as text/plain or urlencoded."""
    body = json.dumps(
        {"model": LANE, "prompt": "Hi", "stream": False, "options": {"num_predict": 1}}
    )
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        headers = {"content-type": content_type, "origin": "http://localhost:3000"}
        assert http.post("/api/generate", content=body, headers=headers).status_code == 403
    # Without an Origin (not a browser), text/plain alone is refused: 415; a form can
    # send JSON so. `curl -d`'s urlencoded (Ollama's examples) is read as JSON: a form
    # of that type percent-encodes `{` and `"`.
    response = http.post("/api/generate", content=body, headers={"content-type": "text/plain"})
    assert response.status_code == 415, response.text
    assert "application/json" in response.json()["error"]
    curl = {
        **headers_for("ollama", KEYS["admin"]),
        "content-type": "application/x-www-form-urlencoded",
    }
    response = http.post("/api/generate", content=body, headers=curl)
    assert response.status_code == 200, response.text


def test_an_allowed_origin_gets_cors(http: httpx.Client) -> None:
    preflight = http.request(
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type"
    response = http.post(
        "/v1/chat/completions",
        json={"model": LANE, "messages": MESSAGES, **ONE},
        headers={"origin": ORIGIN, "authorization": f"Bearer {KEYS['user']}"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ORIGIN


# --- gRPC ------------------------------------------------------------------------


def metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return () if key is None else (("authorization", f"Bearer {key}"),)


def inference_calls(
    stub: inference_pb2_grpc.InferenceStub,
) -> dict[str, Callable[[tuple[tuple[str, str], ...]], Any]]:
    sampling = inference_pb2.Sampling(max_tokens=1)
    chat = inference_pb2.ChatRequest(
        model=LANE, messages=[inference_pb2.Message(role="user", content="Hi")], sampling=sampling
    )
    return {
        "Chat": lambda md: list(stub.Chat(chat, metadata=md, timeout=60)),
        "Complete": lambda md: list(
            stub.Complete(
                inference_pb2.CompleteRequest(model=LANE, prompt="Hi", sampling=sampling),
                metadata=md,
                timeout=60,
            )
        ),
        "Embed": lambda md: stub.Embed(
            inference_pb2.EmbedRequest(model=LANE, inputs=["Hi"]), metadata=md, timeout=60
        ),
        "Tokenize": lambda md: stub.Tokenize(
            inference_pb2.TokenizeRequest(model=LANE, text="Hi"), metadata=md, timeout=60
        ),
        "ListModels": lambda md: stub.ListModels(
            inference_pb2.ListModelsRequest(), metadata=md, timeout=60
        ),
        # A load (no keep_alive_s): an unload would put the Lane to sleep.
        "KeepAlive": lambda md: stub.KeepAlive(
            inference_pb2.KeepAliveRequest(model=LANE), metadata=md, timeout=60
        ),
    }


def control_calls(
    stub: control_pb2_grpc.ControlStub,
) -> dict[str, Callable[[tuple[tuple[str, str], ...]], Any]]:
    policy = {
        "apiVersion": "blazar.dev/v1alpha1",
        "kind": "SLOPolicy",
        "metadata": {"name": "auth-test"},
        "spec": {"priority": 1},
    }

    def watch(md: tuple[tuple[str, str], ...]) -> Any:
        stream = stub.Watch(control_pb2.WatchRequest(kind="Lane"), metadata=md, timeout=60)
        try:
            return next(stream)
        finally:
            stream.cancel()

    def apply_and_delete(md: tuple[tuple[str, str], ...]) -> Any:
        request = control_pb2.ApplyRequest(objects_json=[json.dumps(policy)])
        stub.Apply(request, metadata=md, timeout=60)
        return stub.Delete(
            control_pb2.DeleteRequest(kind="SLOPolicy", name="auth-test"), metadata=md, timeout=60
        )

    def logs(md: tuple[tuple[str, str], ...]) -> Any:
        stream = stub.Logs(control_pb2.LogsRequest(lane=LANE), metadata=md, timeout=60)
        try:
            return next(stream)
        finally:
            stream.cancel()

    return {
        "Apply": lambda md: stub.Apply(
            control_pb2.ApplyRequest(objects_json=[json.dumps(policy)], dry_run=True),
            metadata=md,
            timeout=60,
        ),
        "Get": lambda md: stub.Get(
            control_pb2.GetRequest(kind="Lane", name=LANE), metadata=md, timeout=60
        ),
        "List": lambda md: stub.List(control_pb2.ListRequest(kind="Lane"), metadata=md, timeout=60),
        "Delete": apply_and_delete,
        "Watch": watch,
        "Events": lambda md: stub.Events(
            control_pb2.EventsRequest(limit=1), metadata=md, timeout=60
        ),
        "Logs": logs,
        "Top": lambda md: stub.Top(control_pb2.TopRequest(), metadata=md, timeout=60),
        "Version": lambda md: stub.Version(control_pb2.VersionRequest(), metadata=md, timeout=60),
    }


def test_the_matrix_calls_every_control_method() -> None:
    """A new Control RPC must be added to `control_calls`, so the tests below check it."""
    service = control_pb2.DESCRIPTOR.services_by_name["Control"]
    with grpc.insecure_channel("localhost:1") as channel:
        calls = control_calls(control_pb2_grpc.ControlStub(channel))
    assert set(calls) == {m.name for m in service.methods}


def refused(
    rpc: Callable[[tuple[tuple[str, str], ...]], Any], md: tuple[tuple[str, str], ...]
) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        rpc(md)
    err = info.value
    return err.code(), dict(err.trailing_metadata() or ()).get("blazar-reason", "")


def test_every_inference_method_checks_the_key(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.grpc) as channel:
        calls = inference_calls(inference_pb2_grpc.InferenceStub(channel))
        for name, rpc in calls.items():
            for key in (None, WRONG):
                assert refused(rpc, metadata(key)) == (
                    grpc.StatusCode.UNAUTHENTICATED,
                    "UNAUTHENTICATED",
                ), (name, key)
            if name == "ListModels":
                assert not rpc(metadata(KEYS["outsider"])).models
            else:
                # As for a model that does not exist: it is not told the Lane is there.
                assert refused(rpc, metadata(KEYS["outsider"])) == (
                    grpc.StatusCode.NOT_FOUND,
                    "MODEL_NOT_FOUND",
                ), name
            for tenant in ("user", "admin"):
                assert rpc(metadata(KEYS[tenant])) is not None, (name, tenant)


def test_a_refused_key_is_logged_with_its_source_and_never_the_key(
    daemon: Daemon, http: httpx.Client
) -> None:
    since = daemon.log_path.stat().st_size
    call(http, "GET", "/v1/models", None, headers_for("openai", WRONG))
    with grpc.insecure_channel(daemon.grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        refused(lambda md: stub.ListModels(inference_pb2.ListModelsRequest(), metadata=md), ())

    def logged() -> list[dict[str, Any]] | None:
        lines = daemon.events("request.rejected", since=since)
        return lines if len(lines) >= 2 else None

    rejected = wait_for(logged, timeout=5, what="two request.rejected lines")
    by_source = {("path" in r): r for r in rejected}
    assert by_source[True]["credential"] == "unknown"
    assert by_source[True]["client"].startswith("127.0.0.1:")
    assert by_source[False]["credential"] == "missing"
    assert by_source[False]["rpc"] == "/blazar.v1.Inference/ListModels"
    assert by_source[False]["peer"]
    assert all(r["reason"] == "UNAUTHENTICATED" for r in rejected)
    assert WRONG not in daemon.log_path.read_text(errors="replace")


def test_every_control_method_over_tcp_needs_an_admin_key(daemon: Daemon) -> None:
    with grpc.insecure_channel(daemon.grpc) as channel:
        calls = control_calls(control_pb2_grpc.ControlStub(channel))
        for name, rpc in calls.items():
            for key in (None, WRONG):
                assert refused(rpc, metadata(key)) == (
                    grpc.StatusCode.UNAUTHENTICATED,
                    "UNAUTHENTICATED",
                ), (name, key)
            for tenant in ("user", "outsider"):
                assert refused(rpc, metadata(KEYS[tenant])) == (
                    grpc.StatusCode.PERMISSION_DENIED,
                    "ADMIN_REQUIRED",
                ), (name, tenant)
            assert rpc(metadata(KEYS["admin"])) is not None, name


def test_control_on_the_owners_socket_needs_no_key(daemon: Daemon) -> None:
    assert daemon.control.startswith("unix:")
    socket_path = Path(daemon.control.removeprefix("unix:"))
    assert socket_path.stat().st_mode & 0o777 == 0o600
    assert socket_path.parent.stat().st_mode & 0o777 == 0o700
    with grpc.insecure_channel(daemon.control) as channel:
        for name, rpc in control_calls(control_pb2_grpc.ControlStub(channel)).items():
            assert rpc(()) is not None, name


def test_the_cli_uses_a_key_over_tcp(daemon: Daemon) -> None:
    argv = [sys.executable, "-m", "blazar.cli", "--server", daemon.grpc, "get", "lanes"]
    env = {k: v for k, v in os.environ.items() if k != "BLAZAR_API_KEY"}
    refused_ = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert refused_.returncode == 1
    assert refused_.stderr.startswith("Error from server (Unauthenticated):"), refused_.stderr
    user = subprocess.run(
        argv, capture_output=True, text=True, cwd=REPO, timeout=60,
        env={**env, "BLAZAR_API_KEY": KEYS["user"]},
    )  # fmt: skip
    assert user.returncode == 1
    assert user.stderr.startswith("Error from server (AdminRequired):"), user.stderr
    admin = subprocess.run(
        [*argv[:5], "--api-key", KEYS["admin"], *argv[5:]],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60,
    )  # fmt: skip
    assert admin.returncode == 0, admin.stderr
    assert LANE in admin.stdout


# --- rate limits and reloads -------------------------------------------------------


def test_a_tenant_past_its_rate_limit_gets_429_with_retry_after(http: httpx.Client) -> None:
    headers = {"authorization": f"Bearer {KEYS['limited']}"}
    body = {"model": LANE, "input": "Hi"}
    statuses = [http.post("/v1/embeddings", json=body, headers=headers) for _ in range(3)]
    assert [r.status_code for r in statuses[:2]] == [200, 200]
    limited = statuses[2]
    assert limited.status_code == 429, limited.text
    assert limited.json()["error"]["code"] == "rate_limited"
    # Two requests per minute: the next one in about 30 s.
    assert 1 <= int(limited.headers["retry-after"]) <= 30
    anthropic = http.post(
        "/v1/messages/count_tokens",
        json={"model": LANE, "messages": MESSAGES},
        headers={"x-api-key": KEYS["limited"]},
    )
    assert anthropic.status_code == 429
    assert anthropic.json()["error"]["type"] == "rate_limit_error"
    assert "retry-after" in anthropic.headers


def test_the_auth_file_is_read_again_on_change(
    daemon: Daemon, http: httpx.Client, auth_path: Path
) -> None:
    headers = {"authorization": f"Bearer {KEYS['outsider']}"}
    body = {"model": LANE, "input": "Hi"}
    assert http.post("/v1/embeddings", json=body, headers=headers).status_code == 404
    original = auth_path.read_text()
    try:
        # A file that does not read keeps the one in force, and says why.
        auth_path.write_text("tenants: [{name: broken}]\n")
        wait_for(
            lambda: daemon.events("auth.rejected"), timeout=30, what="the bad auth file logged"
        )
        assert http.post("/v1/embeddings", json=body, headers=headers).status_code == 404
        assert http.get("/v1/models", headers=headers).status_code == 200
        # The outsider is given the Lane.
        auth_path.write_text(original.replace("[some-other-lane]", f"[{LANE}]"))

        def served() -> bool:
            return http.post("/v1/embeddings", json=body, headers=headers).status_code == 200

        wait_for(served, timeout=30, what="the new auth file in force")
    finally:
        auth_path.write_text(original)
        wait_for(
            lambda: http.post("/v1/embeddings", json=body, headers=headers).status_code == 404,
            timeout=30,
            what="the original auth file in force again",
        )


def test_per_tenant_metrics(http: httpx.Client) -> None:
    body = {"model": LANE, "input": "Hi"}
    assert http.post("/v1/embeddings", json=body, headers=headers_for("openai", KEYS["user"]))
    refused_ = http.post(
        "/v1/embeddings", json=body, headers=headers_for("openai", KEYS["outsider"])
    )
    assert refused_.status_code == 404
    text = http.get("/metrics").text
    assert 'blazar_tenant_refusals_total{reason="MODEL_NOT_PERMITTED",tenant="outsider"}' in text
    assert 'blazar_tenant_refusals_total{reason="UNAUTHENTICATED",tenant="unknown"}' in text
    assert 'blazar_tenant_requests_total{tenant="user"}' in text
    assert 'blazar_tenant_tokens_total{kind="prompt",tenant="user"}' in text
