"""The Ollama dialect end to end: the official `ollama` client -> shim -> daemon -> a
real engine worker with the bundled model, on the default fleet (whose Lane answers to
`gemma3:270m`, as Ollama clients name the model).

Nothing here depends on what the model writes: a generation that must run to its
budget is held there by `format` (a string longer than the budget can write: the
longest token of Gemma 3 is 31 bytes), structured output gets a budget its longest
document fits, and the rest asserts mechanics.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from blazar.engine import schema as schemas
from tests.integration import pinning
from tests.integration.harness import Daemon, concurrently

pytestmark = pytest.mark.slow

LANE = "gemma3"
MODEL = "gemma3:270m"
CONTEXT_PER_SLOT = 2048  # manifests/ gives the default lane 2048 tokens per slot
# A JSON string of at least 100 characters: 3 tokens of at most 31 bytes cannot finish
# it, and the grammar keeps the model from stopping, so the budget ends the output.
RUNS_TO_BUDGET: dict[str, Any] = {"type": "string", "minLength": 100}
BUDGET = 3
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def daemon(default_daemon: Daemon) -> Daemon:
    default_daemon.wait_condition("model", "gemma3-270m", "ModelReady", timeout=60)
    return default_daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[ollama.Client]:
    sdk = ollama.Client(host=f"http://{daemon.http}")
    yield sdk
    sdk._client.close()


def assert_statistics(final: Any, *, eval_count: int | None = None) -> None:
    """The last object of a generation: done, why, and Ollama's counters (durations in
    nanoseconds, so a real generation's are far above a million)."""
    assert final.done is True
    assert final.done_reason in ("stop", "length")
    assert final.prompt_eval_count and final.prompt_eval_count > 1
    assert final.eval_count and final.eval_count >= 1
    if eval_count is not None:
        assert (final.done_reason, final.eval_count) == ("length", eval_count)
    assert final.load_duration is not None and final.load_duration >= 0
    assert final.prompt_eval_duration and final.prompt_eval_duration > 1_000
    # Never 0, a single token's included: clients divide eval_count by it.
    assert final.eval_duration and final.eval_duration > 0
    assert final.total_duration and final.total_duration >= final.prompt_eval_duration
    assert final.total_duration < 600 * 10**9


def test_chat_not_streaming(client: ollama.Client) -> None:
    response = client.chat(
        model=MODEL,
        messages=MESSAGES,
        format=RUNS_TO_BUDGET,
        options={"num_predict": BUDGET, "temperature": 0.7, "seed": 1},
        stream=False,
    )
    assert response.model == MODEL
    assert response.message.role == "assistant"
    assert response.message.content.startswith('"')
    assert_statistics(response, eval_count=BUDGET)


def test_chat_streaming(client: ollama.Client) -> None:
    parts = list(
        client.chat(
            model=MODEL,
            messages=MESSAGES,
            format=RUNS_TO_BUDGET,
            options={"num_predict": BUDGET},
            stream=True,
        )
    )
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert len(parts) >= 2
    text = "".join(p.message.content for p in parts)
    assert text.startswith('"') and parts[-1].message.content == ""
    assert_statistics(parts[-1], eval_count=BUDGET)


def test_a_single_token_has_an_eval_duration(client: ollama.Client) -> None:
    for stream in (False, True):
        answer = client.generate(
            model=MODEL,
            prompt="Say something.",
            format=RUNS_TO_BUDGET,
            options={"num_predict": 1},
            stream=stream,
        )
        final = list(answer)[-1] if stream else answer
        assert_statistics(final, eval_count=1)


def test_generate_streaming_and_not(client: ollama.Client) -> None:
    whole = client.generate(
        model=MODEL,
        prompt="Say something.",
        system="You are terse.",
        format=RUNS_TO_BUDGET,
        options={"num_predict": BUDGET},
    )
    assert whole.response.startswith('"')
    assert_statistics(whole, eval_count=BUDGET)
    parts = list(
        client.generate(
            model=MODEL,
            prompt="<start_of_turn>user\nSay something.<end_of_turn>\n<start_of_turn>model\n",
            raw=True,
            format=RUNS_TO_BUDGET,
            options={"num_predict": BUDGET},
            stream=True,
        )
    )
    assert [p.done for p in parts][-1] is True and not any(p.done for p in parts[:-1])
    assert "".join(p.response for p in parts).startswith('"')
    assert_statistics(parts[-1], eval_count=BUDGET)
    # A legacy template renders to the same prompt as the raw one above.
    templated = client.generate(
        model=MODEL,
        prompt="Say something.",
        template="<start_of_turn>user\n{{ .Prompt }}<end_of_turn>\n<start_of_turn>model\n"
        "{{ .Response }}<end_of_turn>\n",
        format=RUNS_TO_BUDGET,
        options={"num_predict": BUDGET},
    )
    assert_statistics(templated, eval_count=BUDGET)
    assert templated.prompt_eval_count == parts[-1].prompt_eval_count


def test_a_generation_may_stop_by_itself(client: ollama.Client) -> None:
    """Without a constraint the model stops when it likes: only the mechanics hold."""
    response = client.chat(model=MODEL, messages=MESSAGES, options={"num_predict": 8})
    assert_statistics(response)
    assert response.eval_count is not None and response.eval_count <= 8


def test_format_schema_output_validates_20_of_20(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    budget = pinning.budget(schemas.grammar(schema))
    assert budget is not None

    def attempt(i: int) -> None:
        options = {"num_predict": budget, "temperature": (0.0, 0.8, 1.4)[i % 3], "seed": i}
        messages = [{"role": "user", "content": "Describe the weather in Paris as JSON."}]
        if i % 2:
            parts = list(
                client.chat(
                    model=MODEL, messages=messages, format=schema, options=options, stream=True
                )
            )
            text, final = "".join(p.message.content for p in parts), parts[-1]
        else:
            final = client.chat(model=MODEL, messages=messages, format=schema, options=options)
            text = final.message.content
        assert final.done_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)

    # Fewer at once than the Lane has slots: each starts on a free one, so its policy
    # (`interactive`, which refuses what it predicts late) never has one wait.
    concurrently(attempt, 20, at_once=3)
    as_json = client.generate(
        model=MODEL, prompt="A JSON object:", format="json", options={"num_predict": BUDGET}
    )
    assert as_json.response.lstrip().startswith("{")


def test_embed_and_embeddings(client: ollama.Client) -> None:
    texts = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Interest rates rose."]
    response = client.embed(model=MODEL, input=texts)
    vectors = response.embeddings
    assert len(vectors) == 3 and all(len(v) == 640 for v in vectors)
    assert all(math.isclose(math.hypot(*v), 1.0, abs_tol=1e-4) for v in vectors)
    assert response.prompt_eval_count and response.prompt_eval_count > len(texts)

    def cos(a: Any, b: Any) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2])
    cut = client.embed(model=MODEL, input=texts[0], dimensions=64).embeddings[0]
    assert len(cut) == 64 and math.isclose(math.hypot(*cut), 1.0, abs_tol=1e-4)
    # The first 64 values of the whole embedding, scaled to unit length.
    norm = math.hypot(*vectors[0][:64])
    assert max(abs(a - b / norm) for a, b in zip(cut, vectors[0][:64], strict=True)) < 1e-4
    with pytest.raises(ollama.ResponseError) as too_many:
        client.embed(model=MODEL, input=texts[0], dimensions=641)
    assert too_many.value.status_code == 400 and "640" in too_many.value.error
    # The older route: the same direction, not scaled to unit length.
    raw = client.embeddings(model=MODEL, prompt=texts[0]).embedding
    norm = math.hypot(*raw)
    assert not math.isclose(norm, 1.0, abs_tol=1e-3)
    assert cos([x / norm for x in raw], vectors[0]) > 0.999
    # num_ctx bounds each input (Ollama cuts a longer one; Blazar refuses it).
    within = client.embed(model=MODEL, input=texts, options={"num_ctx": 16})
    assert len(within.embeddings) == len(vectors)
    assert all(cos(a, b) > 0.999 for a, b in zip(within.embeddings, vectors, strict=True))
    with pytest.raises(ollama.ResponseError) as over:
        client.embed(model=MODEL, input=[texts[0], "word " * 40], options={"num_ctx": 16})
    assert over.value.status_code == 400
    assert "Input 1" in over.value.error and "options.num_ctx is 16" in over.value.error


def test_tags_show_ps_version(client: ollama.Client, daemon: Daemon) -> None:
    listed = {m.model: m for m in client.list().models}
    assert {LANE, MODEL, "gemma3-270m", "default"} <= set(listed)
    entry = listed[MODEL]
    assert entry.details is not None
    assert (entry.details.format, entry.details.family) == ("gguf", "gemma3")
    assert entry.details.quantization_level == "Q4_K_M"
    assert entry.size and entry.size > 100 * 2**20
    sha256 = daemon.get("model", "gemma3-270m")["status"]["sha256"]
    assert entry.digest == sha256

    shown = client.show(MODEL)
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo is not None
    assert shown.modelinfo["general.architecture"] == "gemma3"
    assert shown.modelinfo["gemma3.context_length"] == CONTEXT_PER_SLOT
    assert shown.details is not None and shown.details.parameter_size

    # Ollama reads `gemma3:latest` as `gemma3`; so does Blazar, here and in a chat.
    assert client.show(f"{LANE}:latest").modelinfo == shown.modelinfo
    answer = client.chat(
        model=f"{LANE}:latest", messages=MESSAGES, options={"num_predict": 1}, stream=False
    )
    assert answer.done

    running = client.ps().models
    assert [m.model for m in running] == [LANE]
    assert running[0].context_length == CONTEXT_PER_SLOT
    assert running[0].expires_at is not None and running[0].expires_at.year > 2100

    # Ollama's version whose API Blazar speaks, which clients gate on (Copilot: 0.6.4).
    version = httpx.get(f"http://{daemon.http}/api/version").json()["version"]
    assert tuple(int(part) for part in version.split(".")) >= (0, 6, 4)
    root = httpx.get(f"http://{daemon.http}/")
    assert root.text == "Ollama is running"


def test_num_ctx_or_a_prompt_over_the_lane_is_a_400_naming_both(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=MESSAGES, options={"num_ctx": 8192})
    assert info.value.status_code == 400
    assert "8192" in info.value.error and str(CONTEXT_PER_SLOT) in info.value.error
    fits = client.chat(
        model=MODEL,
        messages=MESSAGES,
        format=RUNS_TO_BUDGET,
        options={"num_ctx": CONTEXT_PER_SLOT, "num_predict": BUDGET},
    )
    assert fits.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as long_prompt:
        client.generate(model=MODEL, prompt="word " * (CONTEXT_PER_SLOT + 50))
    assert long_prompt.value.status_code == 400
    assert str(CONTEXT_PER_SLOT) in long_prompt.value.error
    assert "Shorten the prompt" in long_prompt.value.error


def test_num_ctx_below_the_lane_bounds_prompt_and_generation(client: ollama.Client) -> None:
    """Ollama sizes the context by num_ctx: the generation stops at its end (the format
    keeps the model writing past it, num_predict would allow more), streamed or not,
    chat or generate; a prompt longer than it is refused as one over the Lane is."""
    endless: dict[str, Any] = {"type": "string", "minLength": 1000}
    room = 4
    calls = {
        "chat": lambda options, stream: client.chat(
            model=MODEL, messages=MESSAGES, format=endless, options=options, stream=stream
        ),
        "generate": lambda options, stream: client.generate(
            model=MODEL, prompt="Say something.", format=endless, options=options, stream=stream
        ),
    }
    for name, call in calls.items():
        prompt = call({"num_predict": 1}, False).prompt_eval_count
        num_ctx = prompt + room
        for stream in (False, True):
            answer = call({"num_ctx": num_ctx, "num_predict": 100}, stream)
            final = list(answer)[-1] if stream else answer
            assert (name, final.done_reason) == (name, "length")
            assert final.prompt_eval_count + final.eval_count == num_ctx, (name, stream)
    with pytest.raises(ollama.ResponseError) as long_prompt:
        client.generate(model=MODEL, prompt="word " * 40, options={"num_ctx": 16})
    assert long_prompt.value.status_code == 400
    assert "options.num_ctx is 16 tokens" in long_prompt.value.error


def test_num_predict_beyond_the_context_bounds_without_reserving(client: ollama.Client) -> None:
    """Ollama's num_predict reserves no context (clients send 4096 whatever the Lane
    holds): twice the context is served, ended here by the format's end, where OpenAI's
    max_tokens over the context is a 400. (A generation the context ends stops with
    done_reason "length": tests/unit/test_engine_text.py.)"""
    answer = client.chat(
        model=MODEL,
        messages=MESSAGES,
        format={"type": "boolean"},
        options={"num_predict": 2 * CONTEXT_PER_SLOT},
    )
    assert answer.done_reason == "stop"
    assert answer.message.content.strip() in ("true", "false")


def test_unknown_model_is_404(client: ollama.Client) -> None:
    for call in (
        lambda: client.chat(model="no-such:model", messages=MESSAGES),
        lambda: list(client.chat(model="no-such:model", messages=MESSAGES, stream=True)),
        lambda: client.generate(model="no-such:model", prompt="x"),
        lambda: client.embed(model="no-such:model", input="x"),
        lambda: client.show("no-such:model"),
    ):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 404
        assert "no-such:model" in info.value.error


def test_a_repeated_long_prompt_tells_its_reused_tokens_in_a_header(
    client: ollama.Client, daemon: Daemon
) -> None:
    """Ollama's wire has no cached-token field: the official client gets the whole
    prompt in `prompt_eval_count`, repeat or not, and Blazar's `x-blazar-prefix-reused`
    header (which the client does not show; read here with httpx) tells the reused part,
    on a streamed answer as on a whole one."""
    text = " ".join(f"Line {i} of the manifest lists a crate of pears." for i in range(60))
    messages = [{"role": "user", "content": f"{text}\nCount them {time.time()}."}]
    options = {"num_predict": 1}
    first = client.chat(model=MODEL, messages=messages, options=options)
    repeat = client.chat(model=MODEL, messages=messages, options=options)
    prompt = first.prompt_eval_count
    assert prompt is not None and prompt > 500
    assert repeat.prompt_eval_count == prompt
    for stream in (False, True):
        body = {"model": MODEL, "messages": messages, "options": options, "stream": stream}
        with httpx.stream("POST", f"http://{daemon.http}/api/chat", json=body, timeout=60) as r:
            assert r.status_code == 200
            reused = int(r.headers["x-blazar-prefix-reused"])
            last = json.loads(list(r.iter_lines())[-1])
        assert last["done"] is True and last["prompt_eval_count"] == prompt, stream
        assert prompt // 2 < reused < prompt, stream


def test_bad_requests_are_400_streamed_too(client: ollama.Client) -> None:
    """Streamed, a bad request still comes before the first line, with its status: an
    option Blazar refuses, num_ctx over the Lane (both the shim's), a prompt over it
    (the daemon's)."""
    for named, call in (
        (
            "mirostat",
            lambda: client.generate(model=MODEL, prompt="x", options={"mirostat": 1}, stream=True),
        ),
        (
            "8192",
            lambda: client.chat(
                model=MODEL, messages=MESSAGES, options={"num_ctx": 8192}, stream=True
            ),
        ),
        (
            "Shorten the prompt",
            lambda: client.generate(
                model=MODEL, prompt="word " * (CONTEXT_PER_SLOT + 50), stream=True
            ),
        ),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            list(call())
        assert refused.value.status_code == 400
        assert named in refused.value.error, refused.value.error


def test_refusals_name_what_is_not_supported(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as pull:
        client.pull(MODEL)
    assert pull.value.status_code == 400 and "blazar apply" in pull.value.error
    with pytest.raises(ollama.ResponseError) as option:
        client.generate(model=MODEL, prompt="x", options={"mirostat": 1})
    assert option.value.status_code == 400 and "mirostat" in option.value.error


def test_an_unknown_top_level_field_is_a_400_naming_it(daemon: Daemon) -> None:
    """The `ollama` client sends only fields Blazar knows, so these go by httpx: a top-level
    option or a field of another route is refused by name, never dropped (num_ctx 2
    would otherwise be ignored and the prompt served; `input` on /api/embeddings would
    be a preload answering no embedding)."""
    for path, body, named in (
        ("/api/chat", {"model": MODEL, "messages": MESSAGES, "num_ctx": 2}, "'num_ctx'"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "user": "me"}, "'user'"),
        ("/api/embeddings", {"model": MODEL, "input": "hi"}, "'input'"),
    ):
        response = httpx.post(f"http://{daemon.http}{path}", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert named in response.json()["error"] and path in response.json()["error"]


def test_a_preload_loads_nothing_new(client: ollama.Client) -> None:
    """Ollama clients preload with an empty chat; Blazar's Lanes are loaded already."""
    response = client.chat(model=MODEL, messages=[])
    assert (response.done, response.done_reason) == (True, "load")


def test_a_preload_refuses_a_format_that_is_no_json_schema_as_a_generation_does(
    client: ollama.Client,
) -> None:
    """The engine refuses it on a generation; a preload, which reaches none, in the same
    words."""
    schema = {"type": "object", "properties": 5}
    errors = []
    for call in (
        lambda: client.generate(model=MODEL, format=schema),
        lambda: client.chat(model=MODEL, messages=[], format=schema),
        lambda: client.generate(model=MODEL, prompt="x", format=schema, options={"num_predict": 1}),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 400
        errors.append(refused.value.error)
    assert len(set(errors)) == 1 and "not a valid JSON Schema['properties']" in errors[0], errors


def test_an_unknown_policy_is_a_400_on_every_route(daemon: Daemon) -> None:
    """The data plane checks the policy a request names on every RPC, admitted or not."""
    named = ollama.Client(host=f"http://{daemon.http}", headers={"x-blazar-slo": "no-such-policy"})
    try:
        for call in (
            lambda: named.embed(model=MODEL, input="a"),
            lambda: named.embeddings(model=MODEL, prompt="a"),
            lambda: named.chat(model=MODEL, messages=MESSAGES, options={"num_predict": 1}),
        ):
            with pytest.raises(ollama.ResponseError) as refused:
                call()
            assert refused.value.status_code == 400
            assert "SLOPolicy 'no-such-policy' does not exist" in refused.value.error
    finally:
        named._client.close()


def test_a_whole_answer_says_when_its_first_token_was_expected(daemon: Daemon) -> None:
    """The header the stream carries, on a whole answer too (the `ollama` client shows
    no headers, so plain HTTP)."""
    for path, body in (
        ("/api/chat", {"messages": MESSAGES}),
        ("/api/generate", {"prompt": "Hi"}),
    ):
        response = httpx.post(
            f"http://{daemon.http}{path}",
            json={"model": MODEL, "stream": False, "options": {"num_predict": 1}, **body},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert int(response.headers["x-blazar-predicted-ttft-ms"]) >= 0
