"""The draft runner's bookkeeping against a fake llama.cpp: a scripted "model" whose
next token is a function of everything the sequence's KV cache holds, and a decode
that refuses any position that does not follow what the sequence holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import llama_cpp as lc
import pytest

from blazar.engine import draft
from blazar.engine.speculation import DraftRequest
from tests import launches

N_VOCAB = 50
EOG = 0
N_BATCH = 8
CONTEXT = 256


def model(tokens: Sequence[int]) -> int:
    """The fake model's greedy token after `tokens` (never end-of-generation)."""
    return (sum(tokens) * 7 + len(tokens)) % (N_VOCAB - 1) + 1


def greedy(tokens: Sequence[int], k: int) -> tuple[int, ...]:
    out = list(tokens)
    for _ in range(k):
        out.append(model(out))
    return tuple(out[len(tokens) :])


class FakeLlama:
    """The llama.cpp calls the runner makes, on per-sequence token lists."""

    def __init__(self, *, partial_rm: bool = True) -> None:
        self.kv: dict[int, list[int]] = {}
        self.partial_rm = partial_rm
        # Each decode's (token, position, seq) rows, since the test last looked.
        self.decodes: list[list[tuple[int, int, int]]] = []
        self._predicted: dict[int, int] = {}

    def decode(self, _ctx: Any, batch: Any) -> int:
        rows = [(batch.token[i], batch.pos[i], batch.seq_id[i][0]) for i in range(batch.n_tokens)]
        if not 0 < len(rows) <= N_BATCH:
            return -1
        self._predicted = {}
        for i, (token, pos, seq) in enumerate(rows):
            held = self.kv.setdefault(seq, [])
            if pos != len(held):
                return -1  # llama.cpp: inconsistent sequence positions
            held.append(token)
            if batch.logits[i]:
                self._predicted[i] = model(held)
        self.decodes.append(rows)
        return 0

    def sample(self, _sampler: Any, _ctx: Any, row: int) -> int:
        return self._predicted[row]  # KeyError: no logits asked for that row

    def seq_rm(self, _mem: Any, seq: int, p0: int, p1: int) -> bool:
        assert p1 == -1
        if p0 > 0 and not self.partial_rm:
            return False
        del self.kv.setdefault(seq, [])[max(p0, 0) :]
        return True


@pytest.fixture
def fake() -> FakeLlama:
    return FakeLlama()


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch, fake: FakeLlama) -> Iterator[draft.LlamaDraftRunner]:
    calls = {
        "llama_get_memory": lambda _ctx: "mem",
        "llama_model_get_vocab": lambda _model: "vocab",
        "llama_vocab_n_tokens": lambda _vocab: N_VOCAB,
        "llama_n_ctx_seq": lambda _ctx: CONTEXT,
        "llama_vocab_is_eog": lambda _vocab, token: token == EOG,
        "llama_decode": fake.decode,
        "llama_sampler_sample": fake.sample,
        "llama_memory_seq_rm": fake.seq_rm,
        "llama_free": lambda _ctx: None,
        "llama_model_free": lambda _model: None,
    }
    for name, call in calls.items():
        monkeypatch.setattr(lc, name, call)
    options = draft.DraftOptions(
        launches.spec(slots=2, context_per_slot=CONTEXT, threads=1), n_batch=N_BATCH
    )
    r = draft.LlamaDraftRunner("model", "ctx", options)
    yield r
    r.close()


def in_step(r: draft.LlamaDraftRunner, fake: FakeLlama) -> None:
    """The runner's record of each sequence is exactly what its KV cache holds."""
    for seq in (0, 1):
        assert r.cached_tokens(seq) == tuple(fake.kv.get(seq, ())), seq


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % (N_VOCAB - 1) + 1 for i in range(n)]


def test_a_long_catch_up_is_spread_over_steps(
    runner: draft.LlamaDraftRunner, fake: FakeLlama
) -> None:
    # The long prompt is asked for first: it still must not take the whole chunk.
    tokens = {1: prompt(30, salt=3), 0: prompt(3)}
    drafted_at: list[int] = []
    for step in range(12):
        out = runner.propose(
            [DraftRequest(seq=s, tokens=t, max_tokens=3) for s, t in tokens.items()]
        )
        # Rows that fill in the sequences' own tokens (the rest are draft tokens):
        # one chunk in all, whatever is left to catch up.
        catch_up = [row for d in fake.decodes for row in d if row[1] < len(tokens[row[2]])]
        fake.decodes.clear()
        assert len(catch_up) <= N_BATCH
        in_step(runner, fake)
        # The already running stream drafts at every step.
        assert out[0] == greedy(tokens[0], 3)
        if 1 in out:
            assert out[1] == greedy(tokens[1], 3)
            drafted_at.append(step)
        else:
            assert len(catch_up) == N_BATCH  # not caught up: the whole chunk was used
        # The target accepts what the draft proposed (both follow `model`) and adds
        # its own token; without a draft, a plain decode step adds one.
        for seq, t in tokens.items():
            t.extend(out.get(seq, ()))
            t.append(model(t))
    # Not all in the first call: the 30-token prompt needed several, then drafts resume.
    assert drafted_at[0] > 1
    assert drafted_at == list(range(drafted_at[0], 12))


@pytest.mark.parametrize("partial_rm", [True, False])
def test_bookkeeping_follows_cut_short_catch_up_rollback_and_reuse(
    runner: draft.LlamaDraftRunner, fake: FakeLlama, partial_rm: bool
) -> None:
    fake.partial_rm = partial_rm  # False: a cache that can only drop a whole sequence

    def propose(tokens: list[int]) -> tuple[int, ...]:
        out = runner.propose([DraftRequest(seq=0, tokens=tokens, max_tokens=4)])
        in_step(runner, fake)
        return out.get(0, ())

    def until_drafted(tokens: list[int]) -> tuple[int, ...]:
        for _ in range(4):
            if proposal := propose(tokens):
                return proposal
        raise AssertionError("no draft after 4 chunks")

    first = prompt(20)
    assert propose(first) == ()  # cut short: 8 of 20
    assert len(runner.cached_tokens(0)) == N_BATCH
    # The slot is reused mid catch-up by a prompt sharing 5 tokens.
    second = [*first[:5], *prompt(15, salt=9)]
    assert propose(second) == ()
    assert runner.cached_tokens(0) == tuple(second[: len(runner.cached_tokens(0))])
    proposal = until_drafted(second)
    assert proposal == greedy(second, 4)
    # The target kept one draft token, then chose another: the rest is rolled back
    # (without partial removal, the sequence is dropped and caught up again).
    other = next(t for t in range(1, N_VOCAB) if t != proposal[1])
    rolled = [*second, proposal[0], other]
    assert until_drafted(rolled) == greedy(rolled, 4)
    runner.release(0)
    in_step(runner, fake)
    assert runner.cached_tokens(0) == ()


def test_nothing_is_decoded_for_a_sequence_with_no_room_to_draft(
    runner: draft.LlamaDraftRunner, fake: FakeLlama
) -> None:
    assert runner.propose([DraftRequest(seq=0, tokens=prompt(20), max_tokens=0)]) == {}
    assert fake.decodes == []
    in_step(runner, fake)


def test_the_catch_up_chunk_follows_the_loops_cap(
    monkeypatch: pytest.MonkeyPatch, runner: draft.LlamaDraftRunner, fake: FakeLlama
) -> None:
    """Drafting sequences decode, so their catch-up is a prompt chunk beside decoding:
    no larger than the loop allows one (`catch_up_tokens`), below n_batch."""
    monkeypatch.setattr(runner, "options", dataclasses.replace(runner.options, catch_up_tokens=3))
    tokens = prompt(10)
    for _ in range(3):
        assert runner.propose([DraftRequest(seq=0, tokens=tokens, max_tokens=2)]) == {}
        assert [len(d) for d in fake.decodes] == [3]
        fake.decodes.clear()
        in_step(runner, fake)
    assert runner.propose([DraftRequest(seq=0, tokens=tokens, max_tokens=2)]) == {
        0: greedy(tokens, 2)
    }
