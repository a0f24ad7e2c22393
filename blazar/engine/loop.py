"""The decode thread: sole owner of the llama runtime, the slots and the order of work.

Requests arrive as `jobs.Job`s on a thread-safe queue and wait FIFO for a free slot. A job
takes the free slot whose cache shares the longest prefix with its prompt and keeps
that prefix (`batching.choose_slot`, `batching.reusable_prefix`). Every step packs
the next token of each decoding slot and prefill chunks of the others into one batch
(`batching.plan_step`), decodes it, and samples one token per slot that finished its
prompt or decoded a token. Results leave through each job's `deliver` callback (the
service hops them onto its event loop). A slot keeps its KV cache and token list after
its job ends, for the next job to reuse.

With speculative decoding (`LoopOptions.speculation`), a decoding slot's feed is its
pending token plus up to k drafted ones (n-gram lookup or a draft model, as the
`speculation.SpeculationPolicy` allows), all with logits. After the decode, rows are
sampled in order with the request's own sampler until one disagrees with the draft
(`speculation.Speculation.resolve`): every emitted token is exactly what plain
decoding would have drawn, logprobs and grammar included. The rejected tail is
removed from the KV cache (`llama_memory_seq_rm`) and the slot's token list.

Health reads `Slot.busy` / `Slot.cached_tokens` from other threads: plain attribute
reads of ints and references, which the GIL keeps consistent; nothing else about a
slot is touched outside this thread.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from blazar.api import errors, replicas
from blazar.engine import (
    batching,
    draft,
    jobs,
    kvstore,
    llama,
    logprobs,
    sampling,
    speculation,
    text,
)

log = structlog.get_logger("blazar.engine.loop")


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
    prefill_done: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    drafted: int = 0
    accepted: int = 0
    # The kind of speculation that drafted for it ("" until a draft was verified).
    speculation: str = ""

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.job.prompt)


@dataclass
class Slot:
    """One llama sequence (seq id = index): what its KV cache holds and whom it serves."""

    index: int
    # Exactly the tokens in this sequence's KV cache, position i = tokens[i].
    tokens: list[int] = field(default_factory=list)
    gen: Generation | None = None
    # When it last took a job (a step counter; larger = more recent).
    last_used: int = 0
    # Prompt length of the last job: where a later prompt most likely parts from it.
    prompt_len: int = 0

    @property
    def busy(self) -> bool:
        return self.gen is not None

    @property
    def cached_tokens(self) -> int:
        return len(self.tokens)


# Every stream that decodes waits for the whole step, prompt chunk included: on the
# 2-core dev box a 512-token chunk took 1.0-2.8 s, one token per stream in that time.
# A step that also decodes takes at most this many prompt tokens. Measured there, an
# 800-token prompt arriving beside one stream: the stream's longest pause went from
# 1.02-1.25 s to 0.33-0.41 s, the prompt's first token came 0.1-0.3 s later (1.8-2.1
# against 1.9-2.4 s). A prompt alone still takes n_batch tokens per step.
PREFILL_BESIDE_DECODE = 128


@dataclass(frozen=True)
class LoopOptions:
    runtime: llama.RuntimeOptions
    # Save slot caches here on stop and restore them on start (None: do not).
    kv_persist: Path | None = None
    # Speculative decoding (the runtime then needs 1 + max_draft_tokens outputs per slot).
    speculation: replicas.SpeculationLaunch | None = None
    # Prompt tokens a step takes while other sequences decode (None: n_batch).
    prefill_beside_decode: int | None = PREFILL_BESIDE_DECODE


@dataclass(frozen=True)
class SpeculationStats:
    """Engine-wide speculation counters, for Health."""

    kind: str = ""
    drafted: int = 0
    accepted: int = 0
    disabled_requests: int = 0
    # Why speculation stopped for good (the drafter failed); "" while it works.
    failure: str = ""


@dataclass
class _Speculator:
    """The decode thread's drafter and policy."""

    kind: str
    policy: speculation.SpeculationPolicy
    drafter: speculation.DraftModel
    # Owned native resources of a draft model, closed with the runtime.
    runner: draft.LlamaDraftRunner | None = None

    @classmethod
    def load(
        cls,
        launch: replicas.SpeculationLaunch,
        runtime: llama.Runtime,
        *,
        catch_up_tokens: int | None = None,
    ) -> _Speculator:
        policy = speculation.SpeculationPolicy.from_launch(launch)
        ngram = speculation.drafter_for(launch)
        if ngram is not None:
            return cls(launch.kind, policy, ngram)
        if not launch.draft_model_path:
            raise ValueError(f"speculation kind {launch.kind!r} needs a draft model path")
        options = runtime.options
        runner = draft.LlamaDraftRunner.load(
            draft.DraftOptions(
                model_path=launch.draft_model_path,
                slots=options.slots,
                context_per_slot=runtime.context_per_slot,
                threads=options.threads,
                gpu_layers=options.gpu_layers,
                catch_up_tokens=catch_up_tokens,
            )
        )
        if runner.n_vocab != runtime.n_vocab:
            runner.close()
            raise ValueError("the draft model's vocabulary differs from the target's")
        return cls(launch.kind, policy, runner, runner)

    def stats(self, *, failure: str = "") -> SpeculationStats:
        totals = self.policy.totals
        return SpeculationStats(
            kind=self.kind,
            drafted=totals.drafted,
            accepted=totals.accepted,
            disabled_requests=totals.disabled_requests,
            failure=failure,
        )

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


@dataclass(frozen=True)
class _End:
    """Why a request ends after the token just emitted."""

    reason: jobs.FinishReason
    flush: bool = True


_STOP = object()


class DecodeLoop:
    """The decode thread and its slots; `start` loads the model on that thread."""

    def __init__(
        self, options: LoopOptions, *, on_loaded: Callable[[BaseException | None], None]
    ) -> None:
        self.options = options
        self.slots = [Slot(i) for i in range(options.runtime.slots)]
        self.kv_bytes = 0
        self._on_loaded = on_loaded
        self._inbox: queue.Queue[jobs.Job | object] = queue.Queue()
        self._waiting: collections.deque[jobs.Job] = collections.deque()
        self._runtime: llama.Runtime | None = None
        self._identity: kvstore.Identity | None = None
        self._spec: _Speculator | None = None
        # What Health reports once a failed drafter switched speculation off.
        self._spec_failed: SpeculationStats | None = None
        self._clock = 0
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)

    @property
    def vocab(self) -> llama.Vocab:
        if self._runtime is None:
            raise RuntimeError("model not loaded")
        return self._runtime.vocab

    @property
    def model(self) -> Any:
        """The loaded `llama_model *`, shared with the embedding context; freed when the
        decode thread stops."""
        if self._runtime is None:
            raise RuntimeError("model not loaded")
        return self._runtime.model

    @property
    def model_chat_template(self) -> str | None:
        if self._runtime is None:
            raise RuntimeError("model not loaded")
        return self._runtime.chat_template

    @property
    def architecture(self) -> str:
        """general.architecture of the loaded GGUF ("gemma3", "llama", "qwen2", ...)."""
        if self._runtime is None:
            raise RuntimeError("model not loaded")
        return self._runtime.architecture

    @property
    def context_per_slot(self) -> int:
        return self.options.runtime.context_per_slot

    @property
    def speculation_stats(self) -> SpeculationStats:
        """Counters so far (any thread: reads of ints the decode thread updates)."""
        spec = self._spec
        if spec is None:
            return self._spec_failed or SpeculationStats()
        return spec.stats()

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: jobs.Job) -> None:
        """Queue a job (any thread); it starts when a slot frees up, in order of arrival."""
        self._inbox.put(job)

    def stop(self) -> None:
        """Cancel whatever is left, save the caches if asked, free llama resources and
        end the thread (any thread)."""
        self._inbox.put(_STOP)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # --- decode thread only below ---

    def _run(self) -> None:
        try:
            runtime = llama.Runtime.load(self.options.runtime)
        except BaseException as exc:
            self._on_loaded(exc)
            return
        if self.options.speculation is not None:
            try:
                self._spec = _Speculator.load(
                    self.options.speculation,
                    runtime,
                    catch_up_tokens=self.options.prefill_beside_decode,
                )
            except BaseException as exc:
                runtime.close()
                self._on_loaded(exc)
                return
        self._runtime = runtime
        self.kv_bytes = runtime.kv_bytes
        try:
            self._restore(runtime)
        except Exception:
            log.exception("kv_restore_failed")
        self._on_loaded(None)
        try:
            while self._collect():
                self._admit(runtime)
                try:
                    self._step(runtime)
                except Exception as exc:
                    log.exception("decode_step_failed")
                    for slot in self._active():
                        self._fail(runtime, slot, jobs.Failed(f"decode failed: {exc}"))
        finally:
            for slot in self._active():
                self._finish(runtime, slot, jobs.FinishReason.CANCELLED)
            self._drop_waiting()
            self._save(runtime)
            if self._spec is not None:
                self._spec.close()
            runtime.close()
            self._runtime = None

    def _active(self) -> list[Slot]:
        return [s for s in self.slots if s.gen is not None]

    def _collect(self) -> bool:
        """Move queued jobs to the waiting line, in arrival order; block while there is
        nothing to do.

        False once stopped.
        """
        block = not self._active() and not self._waiting
        added = False
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                break
            if item is _STOP:
                return False
            assert isinstance(item, jobs.Job)
            self._waiting.append(item)
            added, block = True, False
        if added:
            # Jobs are submitted when prepared, which can reorder them (see Job.arrived).
            self._waiting = collections.deque(sorted(self._waiting, key=lambda j: j.arrived))
        return True

    def _admit(self, runtime: llama.Runtime) -> None:
        """End waiting jobs that were cancelled, then start the others, oldest first,
        while slots are free."""
        self._end_cancelled_waiting()
        while self._waiting:
            free = [
                batching.FreeSlot(s.index, s.tokens, s.last_used, runtime.pos_min(s.index))
                for s in self.slots
                if s.gen is None
            ]
            if not free:
                return
            job = self._waiting.popleft()
            # Prompt logprobs need logits at every prompt position: nothing can be kept.
            placement = batching.choose_slot(
                job.prompt, free, n_swa=runtime.n_swa, reuse=not job.params.prompt_logprobs
            )
            slot = self.slots[placement.slot]
            try:
                self._begin(runtime, slot, job, placement.common)
            except Exception as exc:
                log.exception("begin_failed", request_id=job.request_id)
                job.deliver(jobs.Failed(f"could not start generation: {exc}"))

    def _end_cancelled_waiting(self) -> None:
        """Tell each waiting job that was cancelled (a drain cancels queued jobs too)
        that it ended, at this step rather than when a slot frees: its caller waits for
        a final event, and CANCELLED makes the service answer with a retryable status."""
        if not any(job.cancelled for job in self._waiting):
            return
        kept: collections.deque[jobs.Job] = collections.deque()
        for job in self._waiting:
            if job.cancelled:
                job.deliver(_cancelled_before_start(job))
            else:
                kept.append(job)
        self._waiting = kept

    def _begin(self, runtime: llama.Runtime, slot: Slot, job: jobs.Job, common: int) -> None:
        keep = batching.reusable_prefix(
            common, pos_min=runtime.pos_min(slot.index), n_swa=runtime.n_swa
        )
        if keep < len(slot.tokens):
            if keep == 0 or not runtime.truncate(slot.index, keep):
                runtime.clear(slot.index)
                keep = 0
            del slot.tokens[keep:]
        chain = sampling.build_sampler(job.params, prompt=job.prompt)
        if self._spec is not None:
            self._spec.policy.begin(slot.index)
        self._clock += 1
        slot.last_used = self._clock
        slot.prompt_len = len(job.prompt)
        slot.gen = Generation(
            job=job,
            sampler=chain,
            started=time.perf_counter(),
            cached=keep,
            prefilled=keep,
            stops=text.StopMatcher(job.params.stop),
        )

    def _step(self, runtime: llama.Runtime) -> None:
        """One batch: decode tokens first, then prefill chunks (oldest job first)."""
        for slot in self._active():
            assert slot.gen is not None
            if slot.gen.job.cancelled:
                self._finish(runtime, slot, jobs.FinishReason.CANCELLED)
        active = sorted(self._active(), key=lambda s: s.gen.started if s.gen else 0.0)
        if self._spec is not None:
            self._draft(runtime, self._spec, active)
        wants = []
        for slot in active:
            gen = slot.gen
            assert gen is not None
            wants.append(
                batching.Want(
                    slot=slot.index,
                    decode=len(gen.feed),
                    prefill=len(gen.job.prompt) - gen.prefilled,
                    prompt_logits=gen.job.params.prompt_logprobs,
                )
            )
        pieces = batching.plan_step(
            wants,
            max_tokens=runtime.n_batch,
            max_outputs=runtime.n_outputs,
            prefill_beside_decode=self.options.prefill_beside_decode,
        )
        entries: list[tuple[int, int, int, bool]] = []
        placed: list[tuple[Slot, batching.Piece, int]] = []
        for piece in pieces:
            slot = self.slots[piece.slot]
            gen = slot.gen
            assert gen is not None
            if piece.decode:
                tokens = gen.feed[: piece.tokens]
                del gen.feed[: piece.tokens]
            else:
                tokens = gen.job.prompt[gen.prefilled : gen.prefilled + piece.tokens]
                gen.prefilled += piece.tokens
            first, start = len(entries), len(slot.tokens)
            last = len(tokens) - 1
            entries.extend(
                (
                    tok,
                    start + i,
                    slot.index,
                    piece.logits is batching.Logits.ALL
                    or (piece.logits is batching.Logits.LAST and i == last),
                )
                for i, tok in enumerate(tokens)
            )
            slot.tokens.extend(tokens)
            placed.append((slot, piece, first))
        if not entries:
            return
        runtime.decode(entries)
        for slot, piece, first in placed:
            gen = slot.gen
            assert gen is not None
            # What fails from here on (the request's sampler, its logprobs) is that
            # request's own fault: the batch is decoded and the other slots are fine.
            try:
                if piece.decode:
                    self._after_decode(runtime, slot, first, piece.tokens)
                else:
                    self._after_prefill(runtime, slot, first, piece)
            except errors.InvalidRequest as exc:
                # A contradiction in the request itself that showed only now.
                log.info("request_invalid", request_id=gen.job.request_id, error=exc.message)
                if slot.gen is gen:
                    self._fail(runtime, slot, jobs.Failed.invalid(exc))
            except Exception as exc:
                log.exception("sampling_failed", request_id=gen.job.request_id)
                if slot.gen is gen:
                    self._fail(runtime, slot, jobs.Failed(f"sampling failed: {exc}"))

    def _after_prefill(
        self, runtime: llama.Runtime, slot: Slot, first: int, piece: batching.Piece
    ) -> None:
        gen = slot.gen
        assert gen is not None
        prompt = gen.job.prompt
        if piece.logits is batching.Logits.ALL:
            # Row i holds the logits after prompt position p0 + i, predicting p0 + i + 1.
            p0 = gen.prefilled - piece.tokens
            targets = prompt[p0 + 1 : gen.prefilled + 1]
            rows = runtime.logits(first, len(targets)) if targets else None
            if rows is not None:
                gen.prompt_scores.extend(
                    logprobs.score(rows, targets, top=gen.job.params.top_logprobs)
                )
        if not gen.prefilling:
            gen.prefill_done = time.perf_counter()
            self._on_token(runtime, slot, first + piece.tokens - 1)

    def _draft(self, runtime: llama.Runtime, spec: _Speculator, active: list[Slot]) -> None:
        """Extend decoding slots' feeds with drafted tokens, as the policy allows.

        Each draft is capped so that the step cannot emit past max_tokens or the
        slot's context, and so that every decoding slot's rows fit the context's
        output rows (`batching.plan_step` would otherwise leave a slot out).
        """
        decoding = [s for s in active if s.gen is not None and len(s.gen.feed) == 1]
        spare = min(runtime.n_outputs, runtime.n_batch) - sum(
            len(s.gen.feed) for s in active if s.gen is not None
        )
        requests: list[speculation.DraftRequest] = []
        for slot in decoding:
            gen = slot.gen
            assert gen is not None
            room = min(
                gen.job.max_tokens - gen.completion,
                self.context_per_slot - len(slot.tokens),
                spare + 1,
            )
            k = spec.policy.draft_budget(slot.index, active=len(active), room=room - 1)
            if k > 0:
                spare -= k
                requests.append(
                    speculation.DraftRequest(
                        seq=slot.index, tokens=[*slot.tokens, gen.feed[0]], max_tokens=k
                    )
                )
        if not requests:
            return
        try:
            proposed = spec.drafter.propose(requests)
        except Exception as exc:
            # Drafting only saves time, and a drafter that failed half-way (a draft
            # model's decode) no longer knows what its cache holds: speculation is off
            # for the rest of this worker's life, and every request decodes plainly.
            # Health says so (an operator sees a slower replica, not a quiet one).
            log.exception("drafting_failed", kind=spec.kind)
            self._spec_failed = spec.stats(failure=f"the {spec.kind} drafter failed: {exc}")
            self._spec = None
            spec.close()
            return
        drafts = {r.seq: proposed.get(r.seq, ())[: r.max_tokens] for r in requests}
        # Every other sequence's rows count too: all rows go through one output matmul.
        rows = sum(1 for s in active if s.gen is not None and s.gen.feed)
        for seq, tokens in spec.policy.align(drafts, rows=rows).items():
            gen = self.slots[seq].gen
            assert gen is not None
            gen.feed.extend(tokens)

    def _after_decode(self, runtime: llama.Runtime, slot: Slot, first: int, count: int) -> None:
        """Sample after decoding the slot's fed tokens (entries first .. first+count-1).

        One fed token: sample its successor. The pending token plus a draft: sample
        row by row while the target agrees with the draft, emit those tokens, and cut
        the rejected rest from the KV cache; the last emitted token is the next feed.
        """
        gen = slot.gen
        assert gen is not None
        step = speculation.Speculation.fed(seq=slot.index, tokens=slot.tokens, count=count)
        end: _End | None = None

        def sample(i: int) -> int | None:
            nonlocal end
            if end is not None:
                return None
            # Row i's token follows position + i: that many + 1 tokens are then valid.
            token, end = self._emit(runtime, slot, first + i, cached=step.position + i + 1)
            return token

        outcome = step.resolve(sample)
        if outcome.rollback_from is not None:
            if not runtime.truncate(slot.index, outcome.rollback_from):
                # Cannot happen with a full-size KV cache; never decode on a stale one
                # (failing clears the slot's cache).
                self._fail(runtime, slot, jobs.Failed("could not roll back a rejected draft"))
                return
            del slot.tokens[outcome.rollback_from :]
        if outcome.drafted:
            gen.drafted += outcome.drafted
            gen.accepted += outcome.accepted
            assert self._spec is not None
            gen.speculation = self._spec.kind
            self._spec.policy.record(slot.index, drafted=outcome.drafted, accepted=outcome.accepted)
        if end is not None:
            self._finish(runtime, slot, end.reason, flush=end.flush)
        else:
            gen.feed.append(outcome.emitted[-1])

    def _on_token(self, runtime: llama.Runtime, slot: Slot, index: int) -> None:
        """Sample the first token after the prompt from batch entry `index`."""
        token, end = self._emit(runtime, slot, index, cached=len(slot.tokens))
        if end is not None:
            self._finish(runtime, slot, end.reason, flush=end.flush)
        else:
            assert slot.gen is not None
            slot.gen.feed.append(token)

    def _emit(
        self, runtime: llama.Runtime, slot: Slot, index: int, *, cached: int
    ) -> tuple[int, _End | None]:
        """Sample from batch entry `index`, stream the text; say whether the request ends.

        `cached` counts the slot's tokens up to the one whose logits are at `index`
        (during verification the slot also holds drafts that may yet be rejected).
        The caller finishes the request (after fixing the slot's cache when a draft
        was rejected), so that the slot is consistent before it is freed.
        """
        gen = slot.gen
        assert gen is not None
        params = gen.job.params
        # Copied before sampling: the raw distribution, before bias and grammar.
        row = runtime.logits(index).copy() if params.logprobs else None
        token = runtime.sample(gen.sampler, index)
        now = time.perf_counter()
        gen.completion += 1
        gen.untold += 1
        gen.first_token = gen.first_token or now
        gen.last_token = now
        if runtime.vocab.is_eog(token):
            # The end-of-generation token has no text, so no logprobs entry either.
            return token, _End(jobs.FinishReason.STOP)
        if row is not None:
            gen.scores.extend(logprobs.score(row, [token], top=params.top_logprobs))
            gen.score_starts.append(gen.decoded)
        piece = gen.utf8.feed(runtime.vocab.piece(token))
        gen.decoded += len(piece)
        result = gen.stops.feed(piece)
        if result.stopped:
            # Logprobs cover the tokens that produced returned text: one whose text
            # begins inside the stop string produced none.
            keep = sum(1 for start in gen.score_starts if start < result.stop_at)
            del gen.scores[keep:], gen.score_starts[keep:]
        if result.text:
            gen.job.deliver(jobs.TextDelta(result.text, gen.untold, tuple(gen.scores)))
            gen.untold = 0
            gen.scores.clear()
            gen.score_starts.clear()
        if result.stopped:
            return token, _End(jobs.FinishReason.STOP, flush=False)
        if gen.completion >= gen.job.max_tokens or cached >= self.context_per_slot:
            return token, _End(jobs.FinishReason.LENGTH)
        return token, None

    def _finish(
        self, runtime: llama.Runtime, slot: Slot, reason: jobs.FinishReason, *, flush: bool = True
    ) -> None:
        """Free the slot (its cache stays for reuse), then tell the job how it ended.

        In that order, so a caller that has seen its final chunk finds the slot free.
        """
        gen = slot.gen
        assert gen is not None
        job = gen.job
        tail = gen.stops.flush() if flush and reason is not jobs.FinishReason.CANCELLED else ""
        ms = 1000.0
        first = gen.first_token or gen.started
        finished = jobs.Finished(
            reason=reason,
            slot=slot.index,
            prompt_tokens=len(job.prompt),
            completion_tokens=gen.completion,
            cached_tokens=gen.cached,
            queue_ms=(gen.started - job.arrived) * ms,
            prefill_ms=((gen.prefill_done or gen.started) - gen.started) * ms,
            ttft_ms=(first - job.arrived) * ms if gen.first_token else 0.0,
            decode_ms=((gen.last_token or first) - first) * ms,
            prompt_logprobs=tuple(gen.prompt_scores),
            speculation=gen.speculation,
            drafted_tokens=gen.drafted,
            accepted_tokens=gen.accepted,
        )
        untold, scores = gen.untold, tuple(gen.scores)
        self._release(runtime, slot, keep_cache=True)
        if tail or scores:
            job.deliver(jobs.TextDelta(tail, untold, scores))
        job.deliver(finished)

    def _fail(self, runtime: llama.Runtime, slot: Slot, failure: jobs.Failed) -> None:
        assert slot.gen is not None
        job = slot.gen.job
        self._release(runtime, slot, keep_cache=False)
        job.deliver(failure)

    def _release(self, runtime: llama.Runtime, slot: Slot, *, keep_cache: bool) -> None:
        assert slot.gen is not None
        # Recency counts from the end of use too: a long generation that just finished
        # is the conversation most likely to continue (see batching.choose_slot).
        self._clock += 1
        slot.last_used = self._clock
        slot.gen.sampler.free()
        if self._spec is not None:
            self._spec.policy.release(slot.index)
        if not keep_cache:
            runtime.clear(slot.index)
            slot.tokens.clear()
            if self._spec is not None:
                self._spec.drafter.release(slot.index)
        slot.gen = None

    def _drop_waiting(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, jobs.Job):
                self._waiting.append(item)
        # As for a running job cut off by the stop: CANCELLED, which the service
        # answers with a retryable UNAVAILABLE.
        while self._waiting:
            job = self._waiting.popleft()
            job.deliver(_cancelled_before_start(job))

    # --- KV persistence ---

    def _identity_of(self, runtime: llama.Runtime) -> kvstore.Identity:
        if self._identity is None:
            self._identity = kvstore.Identity.of(
                self.options.runtime, context_per_slot=runtime.context_per_slot
            )
        return self._identity

    def _restore(self, runtime: llama.Runtime) -> None:
        directory = self.options.kv_persist
        if directory is None or not directory.is_dir():
            return
        for index, tokens in kvstore.restore(
            runtime, directory, self._identity_of(runtime)
        ).items():
            self.slots[index].tokens = tokens

    def _save(self, runtime: llama.Runtime) -> None:
        directory = self.options.kv_persist
        if directory is None:
            return
        # A saved state keeps only the sliding window's last positions, so it can be
        # reused only by a prompt that contains the whole saved sequence. Cut each slot
        # back to its last prompt first: a repeated prompt, or the next turn of the same
        # conversation, then contains it; a saved answer would almost never be matched.
        for slot in self.slots:
            if 0 < slot.prompt_len < len(slot.tokens) and runtime.truncate(
                slot.index, slot.prompt_len
            ):
                del slot.tokens[slot.prompt_len :]
        try:
            kvstore.save(
                runtime,
                directory,
                self._identity_of(runtime),
                {s.index: list(s.tokens) for s in self.slots},
            )
        except Exception:
            log.exception("kv_save_failed")


def _cancelled_before_start(job: jobs.Job) -> jobs.Finished:
    """The end of a job cancelled while it waited for a slot (it never had one: -1)."""
    return jobs.Finished(
        reason=jobs.FinishReason.CANCELLED,
        slot=-1,
        prompt_tokens=len(job.prompt),
        completion_tokens=0,
        cached_tokens=0,
        queue_ms=(time.perf_counter() - job.arrived) * 1000.0,
        prefill_ms=0.0,
        ttft_ms=0.0,
        decode_ms=0.0,
    )
