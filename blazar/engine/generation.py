"""One request's generation: what it has produced and what its caller has been told.

A `Generation` lives in a slot from the moment its job starts until it ends. The
decode loop samples tokens for it; the generation turns each token into text (UTF-8
safe, stop strings held back until they cannot match), keeps its logprobs aligned
with the text they produced, counts it against `max_tokens`, and says when the
request is over (`End`). It builds its own `jobs.Finished` from its timings. Decode
thread only, like the slot that holds it.

A generation can leave its slot and come back (`parking`): it is kept whole meanwhile,
its native sampler included, and `pause` / `unpause` keep the time parked out of its
prefill and decode figures. Back in a slot without its cache, it prefills its tokens
again (`refill`) before the pending token in `feed` is decoded.

Its prefill is timed from the first step that carries its prompt (`prompt_began`), not
from its start: the loop prefills new prompts one after another, so a prompt that
started beside others waits for their chunks first (`Finished.prefill_wait_ms`), and
that wait is no part of what its own prompt cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from blazar.engine import jobs, llama, logprobs, sampling, text

_MS = 1000.0


@dataclass(frozen=True)
class End:
    """Why a request ends after the token just emitted."""

    reason: jobs.FinishReason
    # Whether text held back for a possible stop string still goes out.
    flush: bool = True


@dataclass
class Generation:
    """Progress of the job a slot is serving."""

    job: jobs.Job
    sampler: sampling.Sampler
    started: float
    # Prompt tokens found in the slot's cache (kept, not prefilled).
    cached: int = 0
    prefilled: int = 0
    # Sampled but not yet decoded into the KV cache: one token, or (with speculation)
    # the verified token followed by drafted ones.
    feed: list[int] = field(default_factory=list)
    # Tokens to prefill again before `feed` is decoded: its cache as it was when it was
    # parked, less what the slot it resumed in still held (empty but after a resume).
    refill: list[int] = field(default_factory=list)
    completion: int = 0
    # Generated tokens whose text has not gone out in a delta yet, and their logprobs,
    # each with where its text begins in `decoded` (the characters produced so far).
    untold: int = 0
    scores: list[logprobs.TokenLogprob] = field(default_factory=list)
    score_starts: list[int] = field(default_factory=list)
    decoded: int = 0
    prompt_scores: list[logprobs.TokenLogprob] = field(default_factory=list)
    utf8: text.Utf8Stream = field(default_factory=text.Utf8Stream)
    stops: text.StopMatcher = field(default_factory=lambda: text.StopMatcher(()))
    # When the first decode step carrying its prompt (a chunk of it) began (0.0: none
    # yet), and the seconds it had been parked by then.
    prompt_began: float = 0.0
    parked_before_prompt_s: float = 0.0
    prefill_done: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    drafted: int = 0
    accepted: int = 0
    # The caller's stop string that ended it ("" otherwise).
    stop_sequence: str = ""
    # Decode steps it took part in, and the sequences decoded in those steps in all.
    decode_steps: int = 0
    decode_batched: int = 0
    # Decode steps that carried a chunk of its prompt, and the sequences in those steps
    # in all (its own chunk, other prompts' chunks, decoding streams' rows).
    prefill_steps: int = 0
    prefill_batched: int = 0
    # The kind of speculation that drafted for it ("" until a draft was verified).
    speculation: str = ""
    # When it was parked (0.0: it is not), and the seconds parked in all and after
    # its first token. Prefilling its tokens again after a resume counts as parked:
    # it is what preemption cost, not decoding.
    parked_at: float = 0.0
    parked_s: float = 0.0
    parked_decoding_s: float = 0.0

    @classmethod
    def begin(cls, job: jobs.Job, *, cached: int) -> Generation:
        """A generation for `job` whose first `cached` prompt tokens are in the cache."""
        return cls(
            job=job,
            sampler=sampling.build_sampler(job.params, prompt=job.prompt),
            started=time.perf_counter(),
            cached=cached,
            prefilled=cached,
            stops=text.StopMatcher(job.params.stop, quiet=job.stop_quiet),
        )

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.job.prompt)

    @property
    def to_prefill(self) -> int:
        """Prompt tokens, or tokens to prefill again after a resume, not in the cache."""
        return len(self.job.prompt) - self.prefilled + len(self.refill)

    @property
    def room(self) -> int:
        """Tokens it may still generate under `max_tokens`."""
        return self.job.max_tokens - self.completion

    def take_prompt(self, count: int) -> list[int]:
        """The next `count` tokens to prefill (to prefill again first), counted as done."""
        if self.refill:
            tokens = self.refill[:count]
            del self.refill[:count]
            return tokens
        tokens = self.job.prompt[self.prefilled : self.prefilled + count]
        self.prefilled += len(tokens)
        return tokens

    def prompt_step(self, began: float, *, sequences: int) -> None:
        """A decode step that began at `began` (perf_counter) carries a chunk of its
        prompt among `sequences` sequences, itself included; the first such step starts
        its prefill."""
        self.prefill_steps += 1
        self.prefill_batched += sequences
        if self.prompt_began:
            return
        self.prompt_began = began
        self.parked_before_prompt_s = self.parked_s + (
            max(0.0, began - self.parked_at) if self.parked_at else 0.0
        )

    def take_feed(self, count: int) -> list[int]:
        tokens = self.feed[:count]
        del self.feed[:count]
        return tokens

    def score_prompt(self, rows: logprobs.Rows, targets: list[int]) -> None:
        self.prompt_scores.extend(logprobs.score(rows, targets, top=self.job.params.top_logprobs))

    def emit(
        self,
        token: int,
        *,
        vocab: llama.Vocab,
        row: logprobs.Rows | None,
        context_full: bool,
    ) -> End | None:
        """Account for a sampled token and send the text it completes; whether the
        request ends with it.

        `row` is the raw logits row it was sampled from, when the job asked for
        logprobs; `context_full` says the slot has no position left after it.
        """
        now = time.perf_counter()
        self.completion += 1
        self.untold += 1
        self.first_token = self.first_token or now
        self.last_token = now
        if vocab.is_eog(token):
            # The end-of-generation token has no text, so no logprobs entry either.
            return End(jobs.FinishReason.STOP)
        if row is not None:
            self.scores.extend(logprobs.score(row, [token], top=self.job.params.top_logprobs))
            self.score_starts.append(self.decoded)
        piece = self.utf8.feed(vocab.piece(token))
        self.decoded += len(piece)
        result = self.stops.feed(piece)
        if result.stopped:
            # Logprobs cover the tokens that produced returned text: one whose text
            # begins inside the stop string produced none.
            keep = sum(1 for start in self.score_starts if start < result.stop_at)
            del self.scores[keep:], self.score_starts[keep:]
        if result.text:
            self.job.deliver(jobs.TextDelta(result.text, self.untold, tuple(self.scores)))
            self.untold = 0
            self.scores.clear()
            self.score_starts.clear()
        if result.stopped:
            self.stop_sequence = result.matched
            return End(jobs.FinishReason.STOP, flush=False)
        if self.completion >= self.job.max_tokens or context_full:
            return End(jobs.FinishReason.LENGTH)
        return None

    def pause(self) -> None:
        """It left its slot (parked); parked again before it went on, it still counts
        from the first time."""
        self.parked_at = self.parked_at or time.perf_counter()

    @property
    def parked_for(self) -> float:
        """Seconds since it was parked (0.0 when it is not)."""
        return time.perf_counter() - self.parked_at if self.parked_at else 0.0

    def unpause(self) -> float:
        """It goes on (back in a slot with its cache, or with its tokens prefilled
        again), or ends parked; the seconds it was parked this time."""
        if not self.parked_at:
            return 0.0
        seconds = time.perf_counter() - self.parked_at
        self.parked_at = 0.0
        self.parked_s += seconds
        if self.first_token:
            self.parked_decoding_s += seconds
        return seconds

    def restart_prefill(self, keep: int) -> None:
        """Prefill the prompt again from position `keep` (parked before its prompt was
        in; resumed without its cache): prompt logprobs past it are scored again."""
        self.prefilled = keep
        del self.prompt_scores[max(keep - 1, 0) :]

    def record_draft(self, kind: str, *, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.speculation = kind

    def conclusion(
        self, reason: jobs.FinishReason, *, slot: int, flush: bool = True
    ) -> list[jobs.Event]:
        """What the caller is told last: held-back text and logprobs, then `Finished`.

        The loop frees the slot before it delivers these, so that a caller that has
        seen its final chunk finds the slot free.
        """
        job = self.job
        self.unpause()
        tail = self.stops.flush() if flush and reason is not jobs.FinishReason.CANCELLED else ""
        first = self.first_token or self.started
        # Parked before its first token: before its prompt's first step (a longer wait
        # for it), and after (a longer prefill); neither counts.
        prefilling_parked = self.parked_s - self.parked_decoding_s
        prompt_began = self.prompt_began or self.started
        waiting_parked = min(self.parked_before_prompt_s, prefilling_parked)
        finished = jobs.Finished(
            reason=reason,
            slot=slot,
            prompt_tokens=len(job.prompt),
            completion_tokens=self.completion,
            cached_tokens=self.cached,
            queue_ms=(self.started - job.arrived) * _MS,
            prefill_ms=max(
                self.prefill_done - prompt_began - (prefilling_parked - waiting_parked), 0.0
            )
            * _MS
            if self.prefill_done
            else 0.0,
            prefill_wait_ms=max(prompt_began - self.started - waiting_parked, 0.0) * _MS
            if self.prefill_done
            else 0.0,
            ttft_ms=(first - job.arrived) * _MS if self.first_token else 0.0,
            decode_ms=((self.last_token or first) - first - self.parked_decoding_s) * _MS,
            parked_ms=self.parked_s * _MS,
            prompt_logprobs=tuple(self.prompt_scores),
            speculation=self.speculation,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            decode_batch=self.decode_batched / self.decode_steps if self.decode_steps else 0.0,
            prefill_batch=self.prefill_batched / self.prefill_steps if self.prefill_steps else 0.0,
            stop_sequence=self.stop_sequence,
        )
        events: list[jobs.Event] = []
        if tail or self.scores:
            events.append(jobs.TextDelta(tail, self.untold, tuple(self.scores)))
        events.append(finished)
        return events


def cancelled_before_start(job: jobs.Job) -> jobs.Finished:
    """The end of a job cancelled while it waited for a slot (it never had one: -1)."""
    return jobs.Finished(
        reason=jobs.FinishReason.CANCELLED,
        slot=-1,
        prompt_tokens=len(job.prompt),
        completion_tokens=0,
        cached_tokens=0,
        queue_ms=(time.perf_counter() - job.arrived) * _MS,
        prefill_ms=0.0,
        ttft_ms=0.0,
        decode_ms=0.0,
    )
