"""Embed and Tokenize on a real engine worker with the bundled Gemma 3 270M."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from blazar._proto.engine.v1 import engine_pb2
from blazar._proto.v1 import inference_pb2
from blazar.api import errors
from blazar.engine import embedding, llama
from blazar.rpc import limits, status
from tests import launches
from tests.integration.engine_harness import (
    CONTEXT_PER_SLOT,
    Spawner,
    Worker,
    poll,
    rpc_error,
)

pytestmark = pytest.mark.slow

GEMMA_3_270M_DIMENSIONS = 640
START_OF_TURN = 105


def embed(worker: Worker, *inputs: str, normalize: bool = False) -> inference_pb2.EmbedResponse:
    response: inference_pb2.EmbedResponse = worker.stub.Embed(
        inference_pb2.EmbedRequest(inputs=inputs, normalize=normalize), timeout=60
    )
    return response


def tokenize(
    worker: Worker, text: str, *, add_special: bool = False, parse_special: bool = False
) -> inference_pb2.TokenizeResponse:
    response: inference_pb2.TokenizeResponse = worker.stub.Tokenize(
        inference_pb2.TokenizeRequest(
            text=text, add_special=add_special, parse_special=parse_special
        ),
        timeout=10,
    )
    return response


def norm(v: Sequence[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))


def test_embeddings_have_the_model_dimension_and_token_counts(worker: Worker) -> None:
    texts = ("Hello there.", "A somewhat longer sentence about the weather today.")
    response = embed(worker, *texts)
    assert [len(e.values) for e in response.embeddings] == [GEMMA_3_270M_DIMENSIONS] * 2
    counts = [len(tokenize(worker, t, add_special=True).tokens) for t in texts]
    assert [e.tokens for e in response.embeddings] == counts
    assert response.prompt_tokens == sum(counts)
    assert all(math.isfinite(x) for e in response.embeddings for x in e.values)


def test_embeddings_are_deterministic_and_independent_of_batching(worker: Worker) -> None:
    alone = embed(worker, "The cat sat on the mat.").embeddings[0].values
    again = embed(worker, "The cat sat on the mat.").embeddings[0].values
    among = embed(worker, "Something else first.", "The cat sat on the mat.").embeddings[1].values
    assert list(alone) == list(again)
    assert max(abs(x - y) for x, y in zip(alone, among, strict=True)) < 1e-4


def test_normalize_scales_to_unit_length(worker: Worker) -> None:
    raw = embed(worker, "Normalise me.").embeddings[0].values
    unit = embed(worker, "Normalise me.", normalize=True).embeddings[0].values
    assert abs(norm(raw) - 1.0) > 0.1  # the raw vector is not already unit length
    assert norm(unit) == pytest.approx(1.0, abs=1e-5)
    scale = norm(raw)
    assert max(abs(u - r / scale) for u, r in zip(unit, raw, strict=True)) < 1e-5


def test_similar_texts_are_closer_than_unrelated_ones(worker: Worker) -> None:
    cat, rug, revenue = (
        e.values
        for e in embed(
            worker,
            "The cat sat on the mat.",
            "A cat was sitting on a rug.",
            "Quarterly revenue grew by 12 percent in fiscal 2023.",
        ).embeddings
    )
    assert cosine(cat, rug) > cosine(cat, revenue)
    assert cosine(cat, rug) > cosine(rug, revenue)


def test_an_input_longer_than_the_context_is_refused(worker: Worker) -> None:
    too_long = "word " * (CONTEXT_PER_SLOT + 10)
    err = rpc_error(lambda: embed(worker, "fine", too_long))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailers = dict(err.trailing_metadata() or ())
    assert trailers[status.REASON_KEY] == "CONTEXT_LENGTH_EXCEEDED"
    assert trailers["blazar-context_length"] == str(CONTEXT_PER_SLOT)
    assert "Input 1" in (err.details() or "")
    # The worker still embeds afterwards.
    assert len(embed(worker, "still here").embeddings) == 1


def test_no_inputs_is_invalid(worker: Worker) -> None:
    err = rpc_error(lambda: embed(worker))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_more_vectors_than_a_response_holds_are_refused_before_any_work(worker: Worker) -> None:
    """1,700 inputs of 640 dimensions were embedded for 43 s, then refused on the way
    back by gRPC's 4 MiB receive limit."""
    started = time.monotonic()
    err = rpc_error(
        lambda: worker.stub.Embed(inference_pb2.EmbedRequest(inputs=["x"] * 1700), timeout=30)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {embedding.max_inputs_for(640)} are embedded" in (err.details() or "")
    assert time.monotonic() - started < 5
    # What fits is well within the receive limit of every client.
    fits = embedding.max_inputs_for(640)
    assert fits * (4 * 640 + 24) <= limits.MAX_ANSWER_BYTES < (fits + 1) * (4 * 640 + 24)
    assert limits.MAX_ANSWER_BYTES < 4 * 2**20


def test_an_empty_input_is_invalid(worker: Worker) -> None:
    # As the HTTP dialects refuse it, rather than embedding the BOS token alone.
    err = rpc_error(lambda: embed(worker, "fine", ""))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Input 1 is empty" in (err.details() or "")


def test_tokenize_round_trips(worker: Worker, model_path: Path) -> None:
    from llama_cpp import Llama

    reference = Llama(str(model_path), vocab_only=True, verbose=False)
    text = "Tokenizers split wörds; naïve café ✓ 12345."
    plain = tokenize(worker, text)
    assert "".join(plain.pieces) == text
    assert list(plain.tokens) == reference.tokenize(text.encode(), add_bos=False, special=False)
    with_bos = tokenize(worker, text, add_special=True)
    assert list(with_bos.tokens) == [reference.token_bos(), *plain.tokens]
    assert with_bos.pieces[0] == "<bos>"
    # Byte-fallback tokens: each is a part of one character, so only the bytes join up.
    hieroglyph = tokenize(worker, "𓀀")
    assert len(hieroglyph.tokens) > 1 and set(hieroglyph.pieces) == {"\ufffd"}
    assert b"".join(hieroglyph.piece_bytes) == "𓀀".encode()
    assert b"".join(plain.piece_bytes) == text.encode()


def test_tokenize_parses_control_tokens_only_when_asked(worker: Worker) -> None:
    text = "<start_of_turn>user"
    literal = tokenize(worker, text)
    parsed = tokenize(worker, text, parse_special=True)
    assert START_OF_TURN not in literal.tokens
    assert "".join(literal.pieces) == text
    assert parsed.tokens[0] == START_OF_TURN
    assert list(parsed.pieces) == ["<start_of_turn>", "user"]


def test_a_text_too_long_to_list_is_counted_with_count_only(worker: Worker) -> None:
    """Every answer says its count. A text whose tokens would take more than one gRPC
    answer may carry is refused as such, naming `count_only`, which counts it (before,
    the engine built the answer and gRPC refused it on the way back, RESOURCE_EXHAUSTED,
    which callers read as "overloaded")."""
    short = tokenize(worker, "word " * 1000)
    assert short.count == len(short.tokens) > 0
    long_text = "word " * 400_000  # 2 MB: under the request limit, its answer is not
    err = rpc_error(
        lambda: worker.stub.Tokenize(inference_pb2.TokenizeRequest(text=long_text), timeout=60)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "count_only" in (err.details() or ""), err.details()
    counted = worker.stub.Tokenize(
        inference_pb2.TokenizeRequest(text=long_text, count_only=True), timeout=60
    )
    assert counted.count > 0 and not counted.tokens and not counted.pieces
    # The count is the listed one's, extended: the repetitions' tokens grow in step
    # (each " word" is whole tokens; the text's first word and its end are counted once).
    half, part = (tokenize(worker, "word " * n).count for n in (50_000, 100_000))
    assert counted.count - part == 6 * (part - half)


def test_an_abandoned_embedding_stops_computing(worker: Worker) -> None:
    """A caller that gives up frees the embedding thread at its next chunk, so the
    requests behind it do not wait for work nobody reads."""
    long_input = "word " * (CONTEXT_PER_SLOT - 10)
    err = rpc_error(
        lambda: worker.stub.Embed(inference_pb2.EmbedRequest(inputs=[long_input] * 4), timeout=0.5)
    )
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    poll(lambda: '"embed_cancelled"' in worker.log.read_text(), what="the cancellation")
    assert len(embed(worker, "after").embeddings) == 1


def test_graceful_stop_after_embedding_exits_cleanly(model_path: Path) -> None:
    """Draining closes the embedding context before the decode thread frees the model."""
    spawner = Spawner(model_path)
    try:
        w = spawner()
        w.wait_ready()
        assert len(embed(w, "one", "two").embeddings) == 2
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=60) == 0, w.log.read_text()
        assert '"stopped"' in w.log.read_text()
    finally:
        spawner.close()


def test_a_drain_lets_a_running_embedding_finish_within_its_grace(spawn: Spawner) -> None:
    """As for generations: only what outlives the grace is refused."""
    w = spawn()
    w.wait_ready()
    inputs = ["word " * 120] * 12
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            lambda: w.stub.Embed(inference_pb2.EmbedRequest(inputs=inputs), timeout=120)
        )
        poll(lambda: '"embedding_context"' in w.log.read_text(), what="the embedding to start")
        drained = w.stub.Drain(engine_pb2.DrainRequest(grace_seconds=60), timeout=90)
        assert drained.abandoned == 0
        assert running.done()  # the drain waited for it
        assert len(running.result().embeddings) == 12


# --- the embedder in-process: output-head skipping, limits, turns ---------------------


@pytest.fixture(scope="module")
def runtime(model_path: Path) -> Iterator[llama.Runtime]:
    rt = llama.Runtime.load(launches.spec(model_path, slots=1, context_per_slot=CONTEXT_PER_SLOT))
    yield rt
    rt.close()


def embedder(rt: llama.Runtime, **options: Any) -> embedding.Embedder:
    return embedding.Embedder(
        model=rt.model, vocab=rt.vocab, context_length=CONTEXT_PER_SLOT, threads=2, **options
    )


def embed_all(e: embedding.Embedder, texts: Sequence[str]) -> list[embedding.Vector]:
    try:
        return asyncio.run(e.embed(texts, normalize=False))
    finally:
        e.close()


def test_skipping_the_output_head_changes_no_vector(runtime: llama.Runtime) -> None:
    texts = ["A short one.", "word " * 150]  # the second spans three decode chunks
    skipping = embedder(runtime)
    assert skipping.skips_output_head
    fast = embed_all(skipping, texts)
    full = embed_all(embedder(runtime, skip_output_head=False), texts)
    assert [v.values for v in fast] == [v.values for v in full]
    chunks = sum(-(-v.tokens // embedding.CHUNK) for v in fast)
    assert skipping.heads_skipped == chunks


def test_too_many_inputs_or_tokens_are_refused(runtime: llama.Runtime) -> None:
    with pytest.raises(errors.InvalidRequest, match="has 3 inputs; at most 2 are embedded"):
        embed_all(embedder(runtime, max_inputs=2), ["a", "b", "c"])
    with pytest.raises(errors.InvalidRequest, match=r"tokens together; at most 50 are") as info:
        embed_all(embedder(runtime, max_total_tokens=50), ["word " * 30, "word " * 30])
    assert info.value.metadata[errors.FIELD_KEY] == "inputs"


def test_an_input_too_long_in_bytes_is_refused_untokenized(runtime: llama.Runtime) -> None:
    """Tokenizing costs about 1 us a byte and no caller's leaving stops it: an input
    that cannot fit by its length alone is refused by name, its tokens a lower bound,
    as a generation's prompt is; not counted first and refused for the total."""
    huge = "abcdefghij " * 100_000
    with pytest.raises(
        errors.ContextLengthExceeded, match=r"Input 1 is at least \d+ tokens"
    ) as info:
        embed_all(embedder(runtime, max_total_tokens=50), ["fine", huge])
    metadata = info.value.metadata
    assert metadata[errors.PROMPT_TOKENS_AT_LEAST_KEY] == "true"
    assert metadata["input"] == "1"
    assert metadata["context_length"] == str(CONTEXT_PER_SLOT)
    assert CONTEXT_PER_SLOT < int(metadata["prompt_tokens"]) <= len(huge)


def test_an_input_over_the_context_is_named_before_the_total(runtime: llama.Runtime) -> None:
    """Splitting into more requests would not help an input too long on its own."""
    too_long = "word " * (CONTEXT_PER_SLOT + 10)
    with pytest.raises(errors.ContextLengthExceeded, match=r"Input 0 is \d+ tokens long") as info:
        embed_all(embedder(runtime, max_total_tokens=50), [too_long])
    assert errors.PROMPT_TOKENS_AT_LEAST_KEY not in info.value.metadata


def test_requests_take_turns_input_by_input(runtime: llama.Runtime) -> None:
    """A one-input request is not held behind every input of a large one."""

    async def scenario() -> tuple[bool, int]:
        e = embedder(runtime)
        try:
            large = asyncio.create_task(e.embed(["word " * 120] * 8, normalize=False))
            started = time.monotonic()
            while e.unfinished_inputs in (0, 8):  # until its first input is done
                assert time.monotonic() - started < 60, "the large request never started"
                await asyncio.sleep(0.01)
            small = await e.embed(["just this"], normalize=False)
            assert len(small) == 1
            large_done_first = large.done()
            vectors = await large
            return large_done_first, len(vectors)
        finally:
            await asyncio.to_thread(e.close)

    large_done_first, count = asyncio.run(scenario())
    assert not large_done_first
    assert count == 8
