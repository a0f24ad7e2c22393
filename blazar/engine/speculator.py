"""The decode thread's speculation: a drafter, its policy, and one step's drafts.

`Speculator.load` builds what a `replicas.SpeculationLaunch` asks for (the pure n-gram
drafter, or a draft model's runner); `Speculator.draft` decides which decoding
sequences draft this step and how many tokens each, within what the step can hold,
and asks the drafter (with the n-gram drafter, a sequence whose match is too short for
a draft of its own takes a weaker one where that costs the step nothing: a filler,
`batching.pad_drafts`); `extend_feeds` does that for the loop's slots. Verification is
`emission`'s (`speculation.Speculation`), which samples the target's rows, and its
count goes back through `record`. Decode thread only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from blazar.api import replicas
from blazar.engine import batching, draft, llama, speculation
from blazar.engine.slots import Slot

PAUSED = speculation.DraftState.PAUSED


@dataclass(frozen=True)
class SpeculationStats:
    """Engine-wide speculation counters, for Health."""

    kind: str = ""
    drafted: int = 0
    accepted: int = 0
    disabled_requests: int = 0
    # Why speculation stopped for good (the drafter failed); "" while it works.
    failure: str = ""


@dataclass(frozen=True)
class Candidate:
    """A sequence with one pending token that may draft after it."""

    seq: int
    # The sequence's cached tokens followed by the pending one.
    tokens: Sequence[int]
    # Tokens it may still emit: what max_tokens and its context leave.
    room: int


@dataclass
class Speculator:
    kind: str
    policy: speculation.SpeculationPolicy
    drafter: speculation.DraftModel
    # Owned native resources of a draft model, closed with the runtime.
    runner: draft.LlamaDraftRunner | None = None
    # The sequences whose drafts this step are fillers (`batching.pad_drafts`).
    fillers: frozenset[int] = frozenset()

    @classmethod
    def load(
        cls,
        launch: replicas.SpeculationLaunch,
        runtime: llama.Runtime,
        *,
        catch_up_tokens: int | None = None,
    ) -> Speculator:
        policy = speculation.SpeculationPolicy.from_launch(launch)
        ngram = speculation.drafter_for(launch)
        if ngram is not None:
            return cls(launch.kind, policy, ngram)
        if not launch.draft_model_path:
            raise ValueError(f"speculation kind {launch.kind!r} needs a draft model path")
        own = draft.draft_spec(
            runtime.spec,
            model_path=launch.draft_model_path,
            context_per_slot=runtime.context_per_slot,
        )
        runner = draft.LlamaDraftRunner.load(
            draft.DraftOptions(own, catch_up_tokens=catch_up_tokens)
        )
        if runner.n_vocab != runtime.n_vocab:
            runner.close()
            raise ValueError("the draft model's vocabulary differs from the target's")
        return cls(launch.kind, policy, runner, runner)

    def extend_feeds(self, active: Sequence[Slot], *, context: int, capacity: int) -> None:
        """Append this step's drafts to the feeds of the `active` slots' generations.

        A slot drafts after its one pending token; a resumed generation still
        prefilling its tokens decodes nothing this step. `capacity` is the rows one
        step can hold. Raises whatever the drafter raises.
        """
        candidates = []
        feeds: dict[int, int] = {}
        for slot in active:
            gen = slot.gen
            if gen is None or gen.refill or not gen.feed:
                continue
            feeds[slot.index] = len(gen.feed)
            if len(gen.feed) == 1:
                room = min(gen.room, context - len(slot.tokens))
                candidates.append(Candidate(slot.index, [*slot.tokens, gen.feed[0]], room))
        drafts = self.draft(
            candidates, active=len(active), feeds=feeds, spare=capacity - sum(feeds.values())
        )
        by_seq = {slot.index: slot for slot in active}
        for seq, tokens in drafts.items():
            gen = by_seq[seq].gen
            assert gen is not None
            gen.feed.extend(tokens)

    def draft(
        self,
        candidates: Sequence[Candidate],
        *,
        active: int,
        feeds: Mapping[int, int],
        spare: int,
    ) -> dict[int, tuple[int, ...]]:
        """Drafted tokens per sequence, to decode after its pending token.

        `active` sequences share the step, `feeds` holds the tokens each decoding
        one feeds before drafts, and `spare` more rows fit the step's outputs. Each
        draft is capped so that the step cannot emit past a sequence's room, and so
        that every decoding sequence's rows fit (`batching.plan_step` would otherwise
        leave one out), then cut to the step's cheapest shape
        (`batching.trim_drafts`). Raises whatever the drafter raises.
        """
        self.fillers = frozenset()
        requests: list[speculation.DraftRequest] = []
        for candidate in candidates:
            room = min(candidate.room, spare + 1)
            k = self.policy.draft_budget(candidate.seq, active=active, room=room - 1)
            if k > 0:
                spare -= k
                requests.append(
                    speculation.DraftRequest(
                        seq=candidate.seq, tokens=candidate.tokens, max_tokens=k
                    )
                )
        if not requests:
            return {}
        proposed = self.drafter.propose(requests)
        drafts = {r.seq: proposed.get(r.seq, ())[: r.max_tokens] for r in requests}
        probes = {seq for seq in drafts if self.policy.sequence(seq).state is PAUSED}
        # Every decoding sequence counts: together they make the step's passes.
        trimmed = batching.trim_drafts(drafts, feeds, probes=probes)
        return self._filled(trimmed, requests, feeds, probes=probes)

    def _filled(
        self,
        drafts: dict[int, tuple[int, ...]],
        requests: Sequence[speculation.DraftRequest],
        feeds: Mapping[int, int],
        *,
        probes: Collection[int],
    ) -> dict[int, tuple[int, ...]]:
        """Fill the sequences the policy let draft but that proposed nothing with the
        n-gram drafter's weaker proposals, where that costs the step nothing
        (`batching.pad_drafts`); remembered as fillers until the next step's drafts."""
        if not isinstance(self.drafter, speculation.NgramDrafter) or not any(drafts.values()):
            return drafts
        empty = [r for r in requests if not drafts.get(r.seq) and r.seq not in probes]
        if not empty:
            return drafts
        padded = batching.pad_drafts(drafts, feeds, self.drafter.fill(empty))
        self.fillers = frozenset(seq for seq, d in padded.items() if d and not drafts.get(seq))
        return padded

    def record(self, seq: int, *, drafted: int, accepted: int) -> None:
        """Account a verified draft of this step (`SpeculationPolicy.record`)."""
        self.policy.record(seq, drafted=drafted, accepted=accepted, filler=seq in self.fillers)

    def moved(self, src: int, dst: int) -> None:
        """A generation moved from sequence `src` to `dst` (`slots.move`): its statistics
        go with it; the drafter forgets both (an n-gram index is rebuilt from the tokens
        at the next draft)."""
        self.policy.move(src, dst)
        self.drafter.release(src)
        self.drafter.release(dst)

    def stats(self, *, failure: str = "") -> SpeculationStats:
        totals = self.policy.totals
        return SpeculationStats(
            kind=self.kind,
            drafted=totals.drafted,
            accepted=totals.accepted,
            disabled_requests=totals.disabled_requests,
            failure=failure,
        )

    def set_threads(self, threads: int) -> None:
        """The draft model computes on the target's share of the cores too."""
        if self.runner is not None:
            self.runner.set_threads(threads)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
