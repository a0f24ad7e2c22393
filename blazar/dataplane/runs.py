"""What runs where on one Lane, as its admission task knows it, and the view of the
Lane that admission decides against.

`LaneRuns` is state only: the runs started and not ended, the ones parked on their
replica and the host memory each holds there, the parks asked of engines and not yet
answered, the runs whose engine refused a park, and the replicas left out since a
request they refused went back to the queue. Its one owner is the Lane's
`dispatcher.LaneDispatcher`, which changes it as events come; nothing here does IO,
logs or reads a clock.

`LaneRuns.view` builds `admission.LaneView` from it, never from constants: slots and
replicas from the route, each running request's tokens left from the Lane's typical
completion less what it generated (its policy's name and maxSlotsPerReplica, by which
admission counts the slots each policy holds), and rates from
`measurements.LaneMeasurements`. A run being parked shows as the urgent ticket that
will start in its slot, and its KV counts toward its replica's parked bytes already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from blazar.dataplane import admission, routing
from blazar.dataplane.measurements import LaneMeasurements, in_flight_token_rates


@dataclass(eq=False)
class Run:
    """A request admission started on a replica."""

    ticket: admission.Ticket
    request_id: str
    replica: routing.Replica
    prompt_chars: int
    # Admission's prediction of its time to first token, from arrival (None: none).
    predicted_ttft_s: float | None = None
    # Tokens relayed so far: written by the relay, read by the forecast.
    generated: int = 0
    # The prompt tokens its replica's cache held, and the prompt's tokens in all, as its
    # engine told the relay with its first chunk (None: not yet, or not told).
    prefix_reused: int | None = None
    prompt_tokens: int | None = None
    # On the dispatcher's clock, when it started, and the prefill its replica's rate
    # predicted then (None: no prefill measured yet): its first token measures the
    # start overhead.
    started_at: float = 0.0
    expected_prefill_s: float | None = None
    # As admission forecast its start: the wait behind the prompts started before it
    # on its replica (left out of the start overhead it measures), and its prefill
    # (start overhead included). Until `first_token_due`, or its first token, its
    # prompt holds the replica's prefill line in the view.
    queue_s: float = 0.0
    prefill_s: float = 0.0
    # Forecast as a prompt alone on its replica (`admission.Dispatch.alone`).
    alone: bool = False
    # On the dispatcher's clock, when its first token came (None: not yet); with
    # `generated` and less the time it spent parked, what it measures of its policy's
    # decode before it finishes.
    first_token_at: float | None = None
    # Seconds it spent parked after its first token, and since when it is parked now.
    parked_s: float = 0.0
    parked_at: float | None = None
    # Seconds it waited for its Lane to wake (idle.sleepAfter), within its queue wait.
    load_s: float = 0.0
    # Asked to resume and not yet answered: its engine holds it parked still, and
    # would refuse to park it again (it is no victim meanwhile).
    resuming: bool = False
    # Its stream ended (set by `LaneDispatcher.end` at once, before the Lane's task
    # reads the end): an engine that finds it gone then dropped it for its caller.
    ended: bool = False
    # Admission's prediction when its first token tests the forecast of a wait (see
    # `dispatcher.LaneDispatcher._start`): measured against it, the forecast's
    # lateness. None: it does not.
    wait_forecast_s: float | None = None
    # Cancels its engine call, once its relay opened one (`withdraw`).
    cancel: Callable[[], object] | None = None
    # Taken back from a replica that missed a health check before its first token:
    # its relay hands it back to the queue (`attempt.Attempts.stream`).
    withdrawn: bool = False

    def taken_back(self) -> bool:
        """Whether it was withdrawn (a call, where the field would be narrowed)."""
        return self.withdrawn

    def withdraw(self) -> None:
        """Take the run back from its replica: its call is cancelled, and its relay,
        seeing `withdrawn`, hands it back to the queue rather than fail it."""
        self.withdrawn = True
        if self.cancel is not None:
            self.cancel()

    @property
    def first_token_due(self) -> float:
        """When admission forecast its first token, on the dispatcher's clock."""
        return self.started_at + self.queue_s + self.prefill_s


# A replica as one engine process: a restarted replica keeps its index, not this.
Identity: TypeAlias = tuple[int, str, int | None]


def identity(replica: routing.Replica) -> Identity:
    return (replica.index, replica.socket, replica.pid)


@dataclass(frozen=True)
class Parking:
    """A park asked of an engine for `preempt`, not yet answered."""

    preempt: admission.Preempt
    victim: Run
    asked_at: float
    # A decode step on the victim's replica at the batch it ran when asked (None: not
    # measured yet): the most a park waits for.
    step_s: float | None = None
    # How many times the engine was asked (`preempting.PARK_TRIES`).
    tries: int = 1
    # The victim's tokens relayed when the engine was last asked: with none, a refusal
    # may only mean its engine had not seated it yet (`LaneDispatcher._park_again`).
    generated_when_asked: int = 0

    @property
    def due(self) -> float:
        """When the forecast that asked the park has the urgent ticket's first token."""
        preempt = self.preempt
        return self.asked_at + preempt.start_s + preempt.queue_s + preempt.prefill_s


# How long a replica that refused a request before its first chunk stays out of the
# view. One whose process died leaves the route before that, and comes back as
# another; one that refused for a cause that passes (the daemon could not open a
# socket to it: too many open files) and still answers its health checks would
# otherwise stay out for as long as it lives, and every request of a Lane with one
# replica would wait for nothing.
EXCLUDED_S = 1.0


@dataclass
class LaneRuns:
    """The Lane's runs by ticket id, and what admission must know of each replica."""

    running: dict[str, Run] = field(default_factory=dict)
    # Runs whose generation is parked on their replica, and the host memory each one
    # holds there (as its Park answer said).
    parked: dict[str, Run] = field(default_factory=dict)
    parked_bytes: dict[str, int] = field(default_factory=dict)
    # Parks asked of engines and not yet answered, by the victim's ticket id: the
    # view shows the urgent request in the victim's slot meanwhile.
    parking: dict[str, Parking] = field(default_factory=dict)
    # Runs whose engine refused to park them, with the tokens they had generated
    # then: no victim again until they have generated more (seated, say).
    refused_parks: dict[str, int] = field(default_factory=dict)
    # KV bytes per cached token, as the engines' Park answers measured them.
    kv_bytes_per_token: int = 0
    # Replicas (as processes) that refused a request before its first chunk, and until
    # when: out of the view until then (`EXCLUDED_S`), or until the route shows them
    # as another process.
    excluded: dict[Identity, float] = field(default_factory=dict)

    def busy(self) -> bool:
        """Whether anything runs, is parked or being parked."""
        return bool(self.running or self.parked or self.parking)

    def parked_total(self) -> int:
        return sum(self.parked_bytes.values())

    def serving(self, route: routing.Route | None) -> Iterable[routing.Replica]:
        """The route's replicas, less the ones left out."""
        if route is None:
            return ()
        return (r for r in route.replicas if identity(r) not in self.excluded)

    def replica(self, route: routing.Route | None, index: int) -> routing.Replica | None:
        return next((r for r in self.serving(route) if r.index == index), None)

    def forget_gone(self, route: routing.Route) -> None:
        """A replica that left the route is gone as that process; forget it."""
        present = {identity(r) for r in route.replicas}
        self.excluded = {k: until for k, until in self.excluded.items() if k in present}

    def stranded(self, route: routing.Route) -> list[Run]:
        """The runs without a first token on replicas that missed a health check
        (`routing.Route.unanswering`): nothing was generated for them, so they may go
        back to the queue for a replica that answers."""
        unanswering = {identity(r) for r in route.unanswering}
        return [
            run
            for run in self.running.values()
            if identity(run.replica) in unanswering
            and run.first_token_at is None
            and not run.ended
            and not run.withdrawn
        ]

    def exclude(self, replica: routing.Replica, *, now: float) -> None:
        """`replica` refused a request before its first chunk: out of the view for
        `EXCLUDED_S`."""
        self.excluded[identity(replica)] = now + EXCLUDED_S

    def readmit(self, now: float) -> None:
        """Replicas whose time out has passed are in the view again."""
        self.excluded = {k: until for k, until in self.excluded.items() if until > now}

    def readmission_at(self) -> float | None:
        """When the first replica left out comes back (None: none is out)."""
        return min(self.excluded.values(), default=None)

    def view(
        self, route: routing.Route | None, measurements: LaneMeasurements, *, now: float
    ) -> admission.LaneView:
        """The Lane as admission sees it at `now` (see the module docstring)."""
        if route is None:
            return admission.LaneView()
        # Read once per view: each running request's figure comes from it. A policy
        # none of whose requests has finished yet reads what its runs in flight measure
        # (else a Lane whose first requests are long generations would see their slots
        # free at once, and urgent work would wait for them instead of preempting).
        in_flight = (
            (run.ticket.policy.name, now - run.first_token_at - run.parked_s, run.generated - 1)
            for run in self.running.values()
            if run.first_token_at is not None and run.ticket.id not in self.parking
        )
        rates = {**in_flight_token_rates(in_flight), **measurements.token_rates}
        replicas = []
        for replica in self.serving(route):
            here = identity(replica)
            mine = [run for run in self.running.values() if identity(run.replica) == here]
            running = [self._holder(run, measurements, rates, now) for run in mine]
            parked = sum(
                self.parked_bytes.get(run.ticket.id, 0)
                for run in self.parked.values()
                if identity(run.replica) == here
            )
            # A park under way: its bytes count already, at the rate parks measured.
            parked += sum(
                self.kv_bytes_per_token * (run.ticket.prompt_tokens + run.generated)
                for run in mine
                if run.ticket.id in self.parking
            )
            replicas.append(
                measurements.replica_view(
                    replica.index,
                    slots=routing.slots_of(route, replica),
                    context_per_slot=routing.context_of(route, replica),
                    running=running,
                    parked_bytes=parked,
                    parked_bytes_max=route.max_parked_bytes,
                    kv_bytes_per_token=self.kv_bytes_per_token,
                    draft_batch_max=route.draft_batch_max,
                )
            )
        return admission.LaneView(
            replicas=tuple(replicas),
            completion_tokens=measurements.completion_tokens,
            completion_share=measurements.completion_share,
            lane_share=measurements.lane_share,
            rates=rates,
            lateness=measurements.lateness,
            starting_context=route.context_length if route.starting else None,
        )

    def _holder(
        self,
        run: Run,
        measurements: LaneMeasurements,
        rates: Mapping[str, admission.TokenRate],
        now: float,
    ) -> admission.Running:
        """What holds the run's slot as admission sees it: the run, or, while the run
        is being parked, the ticket that will start in its slot. A run without its first
        token holds the replica's prefill line until its first token is due, and so does
        that ticket, from when the forecast had it start (once parked) until its first
        token: several urgent tickets that preempt at once are prefilled one after
        another like any others."""
        parking = self.parking.get(run.ticket.id)
        ticket = parking.preempt.ticket if parking is not None else run.ticket
        generated = 0 if parking is not None else run.generated
        if parking is not None:
            prefill_left = max(0.0, parking.due - now)
        elif run.first_token_at is None and run.parked_at is None:
            prefill_left = max(0.0, run.first_token_due - now)
        else:
            prefill_left = 0.0
        expected = measurements.output_tokens(ticket.max_tokens, policy=ticket.policy.name)
        return admission.Running(
            id=ticket.id,
            priority=ticket.policy.priority,
            tokens_left=max(0, expected - generated),
            kv_tokens=ticket.prompt_tokens + generated,
            parkable=not run.resuming and run.generated > self.refused_parks.get(run.ticket.id, -1),
            rate=rates.get(ticket.policy.name),
            policy=ticket.policy.name,
            max_slots_per_replica=ticket.policy.max_slots_per_replica,
            prefill_left_s=prefill_left,
        )


def summary(replica: admission.ReplicaView) -> dict[str, object]:
    """A replica's figures in the forecast, for a refusal's log line."""
    return {
        "replica": replica.index,
        # policy:priority:tokens left, "!" when its engine refused to park it
        "running": [
            f"{r.policy}:{r.priority}:{r.tokens_left}{'' if r.parkable else '!'}"
            for r in replica.running
        ],
        "step_s": rounded(replica.step_s),
        "growth_s": rounded(replica.step_growth_s),
        "prefill_tps": rounded(replica.prefill_tokens_per_s),
        "prefill_fixed_s": rounded(replica.prefill_fixed_s),
        "lone_prefill_tps": rounded(replica.lone_prefill_tokens_per_s),
        "lone_prefill_fixed_s": rounded(replica.lone_prefill_fixed_s),
        "start_overhead_s": rounded(replica.start_overhead_s),
        "lone_start_overhead_s": rounded(replica.lone_start_overhead_s),
        "park_s": rounded(replica.park_s),
        "parked_bytes": replica.parked_bytes,
        "parked_bytes_max": replica.parked_bytes_max,
        "per_step": rounded(replica.tokens_per_step),
    }


def rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)
