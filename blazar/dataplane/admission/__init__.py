"""Admission for one Lane: which waiting request starts next and where, which one a
more urgent request may park, and which are refused.

No IO, no clock, no logging, no asyncio: the data plane's admission task owns one
`LaneQueue` per Lane, passes `now` and a `LaneView` (what the Lane's engines hold and
measure) to every call, and carries out the decisions it gets back. Driving it: on every
event (an arrival, a request that ends, a cancel, a fresh view) and at `next_expiry()`,
call `dispatch`, then `preemption` until it answers None, then `expire`. Apply each
decision to the view passed next (a dispatched ticket runs; a parked one does not).

Modules: `terms` (policies, tickets, the view, the decisions), `forecast` (the
simulation below), `queue` (`LaneQueue`: the order, the bounds, fair share).

Order. A request holds a `Ticket` under one `Policy` (the SLOPolicy it names, else its
Lane's, else `FIFO_POLICY`). Tickets wait in one order per Lane: higher `priority`
first; inside one priority by fair share between tenants; then earliest deadline
first, the deadline being arrival + `ttftTargetMs` (none sorts after every deadline);
then arrival; then id.

Fair share is start-time fair queuing (SFQ, Goyal et al. 1996), one virtual clock per
priority. Each start of a tenant's ticket costs it 1 / its weight in virtual time. The
tier's clock `V` is the virtual start of the ticket started last; a tenant's `F` is the
virtual finish of its ticket started last. The k-th of a tenant's waiting tickets (in
deadline order) starts at max(V, F) + (k - 1) / weight, and tickets run in that order:
under saturation tenants are served in proportion to their weights, one whose tickets
arrive after an idle spell starts at the clock (no credit saved up), and a single
tenant's tickets keep the deadline order. A ticket that waits again after its start
(parked, or its start failed) was charged then: it comes first in its tier, as a
parked generation does in the forecast, and is not charged again. Requests without a
tenant share one (the empty name), of weight 1.

Bounds. At most `maxQueueDepth` tickets of one policy wait on a Lane: one more is
refused at once (QUEUE_FULL) unless an idle slot takes it at once. A ticket that has
waited `maxQueueWaitMs` and cannot start now is taken out and refused (QUEUE_TIMEOUT),
never started late. A cancelled ticket leaves at once. A parked generation waits again
(`requeue`): it comes first in its priority, counts in its policy's depth (parking may
take the depth past the bound; arrivals are then refused), and its waits add up in the
queue time it reports. Having started, it is never refused: neither its wait bound nor
its TTFT target takes it out (its stream is open, and ending it would throw away what
it was sent); it resumes when a slot frees, or leaves with its caller.

Forecast. Every decision reads one simulation of the Lane from `now`, in ticket order
(list scheduling, the model behind every prediction):

- Each replica has `slots` slots. A slot running a request frees after that request's
  remaining prefill (`Running.prefill_left_s`, see the prefill line) and its
  decode time, `tokens_left x step / tokens_per_step`: step is the measured decode step
  at the batch the replica will run while this queue drains (its running requests plus
  the waiting tickets, each policy's at most its cap, at most its slots),
  `step_s + step_growth_s x (batch - 1)`, along the line measured for steps where
  sequences may draft (`draft_step_s`, `draft_step_growth_s`: their draft rows lengthen
  them) or for the others, as the batch falls within the SpecPair's disableAboveBatch
  (`draft_batch_max`) or above it;
  tokens_per_step the accepted tokens per step, 1 without speculation; or, once the
  request's policy has measured it (`TokenRate`), its own seconds per token, scaled
  from the batch it measured at to this one along the drafting line. Above the
  disableAboveBatch nothing drafts: one token a step, whatever was measured with
  drafts. An idle slot is free now.
- Each ticket in order takes the slot that frees first among those its policy's cap
  allows (see Caps; an idle one, then the session's
  `prefer`red replica, then the least loaded replica, then the lowest index), holds it for
  its service time, its wait in the prefill line (below), its prefill
  (`start_overhead_s`, what a start costs beyond the
  prompt as measured, plus its fresh tokens / `prefill_tokens_per_s`, with the fixed
  part and rate measured on every prompt's fresh tokens; fresh: the prompt less what
  the `prefer`red replica's cache holds of it, `Ticket.cached_tokens`, there, and the
  whole prompt elsewhere; for the first ticket on a replica that runs
  nothing, those measured on prompts that had their steps to themselves and the start
  overhead measured against them, `lone_*`) plus the decode time
  of the tokens it will generate (`expected_output`: the share of max_tokens its
  policy's requests generate, else the larger of the Lane's mean completion and its
  share over every policy, else all of max_tokens), and then frees it for the next.
  Its first token comes at start + its wait in the prefill line + prefill. A parked
  generation (`Resume`) takes only a slot of its own replica and costs its remaining
  decode time.
- Context: a fresh ticket takes slots only on the replicas whose context per slot
  holds its `context_tokens` (`LaneView.fitting`): during a `contextPerSlot` rollout an
  old replica may hold less than the Lane says. One that only the starting replica
  would hold waits for it; one that no replica, ready or starting, holds takes any
  slot (its engine, which counts the tokens, answers). It parks work only there too.
- The prefill line: an engine prefills the prompts of new requests one after another
  (its batch takes the prompts' chunks in order of start, a short prompt's before
  longer ones, `api.prefill`), so of k prompts started together on a replica the k-th
  has its first token after the k - 1 before it; a short prompt, after the short ones
  only. Each
  replica's prompts form one line in the forecast. A prompt holds the line for the
  last part of its prefill, its `line_share` (measured: how soon after the first token
  of the prompt ahead a queued prompt's own came, over its prefill; 1, the whole
  prefill, until measured), because the engine overlaps neighbours: the next prompt's
  first chunk shares a step with this one's last, and short prompts share a step.
  Started at `start`, its hold goes in the line's first gap, from where it would
  begin unhindered, that holds it whole, and its first token comes at the end of it
  (a ticket later in the order may start sooner than prompts given to the line before
  it, in a slot that frees sooner). The line starts busy until the latest first token
  due of the runs that have started without one yet (`Running.prefill_left_s`). A
  resume has no prompt to prefill: it neither waits in the line nor holds it. The start
  overhead is part of the prefill the share applies to. The wait
  (`Fate.queue_s`) is part of the ticket's slot time and of its first token, for every
  decision below, and `Dispatch` / `Preempt` carry it, so that the data plane measures
  the start overhead net of it.
- Preemption in the forecast: a ticket whose first token may come past its deadline
  in a slot that is not idle takes instead the slot of a running request of strictly
  lower priority, if parking that request keeps the replica's parked bytes within its
  bound and lets the ticket meet its deadline (the measured park, `park_s`, and a
  decode step, since the engine parks between two steps and goes on with the next
  before the ticket reaches it; then its prefill, after the prompts ahead of it in the
  line), sooner than waiting would. "May
  come past": its wait (for a slot and in the line) and prefill scaled by
  the view's `lateness`, how much later than forecast first tokens after a wait have
  come (measured by the data plane, at least 1, 1 before anything is measured), and
  `WAIT_STEPS` decode steps at the replica's batch later still (the engine moves in
  whole steps, and a wait meets two step ends that the forecast's times smooth over).
  Parking is cheap insurance (the victim pauses and resumes with no token lost), and
  waiting on a forecast that runs early costs the target. The cheapest victim is
  parked: fewest KV tokens, then lowest priority, then replica index and id. The
  victim re-enters the order at its priority, pinned to its replica.
- A measurement an engine has not made yet (None) counts as zero seconds: admission
  never refuses on a guess. With no replica the forecast knows nothing and refuses only
  on the bounds and on deadlines already passed.

Caps. A policy's `maxSlotsPerReplica` (`Policy.max_slots_per_replica`) is the most
slots of one replica its requests hold at once, running or resumed, so that low-priority
work cannot hold every slot and urgent work finds one free at once. The forecast counts
the slots each policy holds on each replica (the running requests' `Running.policy`,
then each slot as the forecast gives it to a ticket): a ticket whose policy holds its
cap on a replica may take only a slot that its own policy holds there (when that
request ends), as if no other slot there were free; below the cap, any slot. So it
waits, within its bounds, and is predicted, refused early, spilled and dispatched as
waiting (`dispatch` starts only tickets that took an idle slot, and a policy at its cap
may take none). A capped ticket parks no work on a replica where its policy is at its
cap. A parked generation does not hold its claim: parking it gives its slot to the
urgent ticket, and its policy holds one slot fewer there. It waits its turn, first in
its priority, and resumes under the same rule as any ticket of its policy: below the
cap on its replica in any slot that frees there, at the cap in the next one its own
policy frees there; one always does (a policy at its cap holds a slot), so it always
resumes. A cap at or above a replica's slots changes nothing there.

Decisions from the forecast. `dispatch` starts the tickets that took an idle slot;
`preemption` names the first ticket that took a victim's slot; `expire` refuses the
tickets past their wait bound and, under `onOverload: reject`, those predicted to miss
their time-to-first-token target (a ticket waiting at its deadline misses it); `arrive`
runs the same simulation with the new ticket in its place and refuses it early
(SLO_UNATTAINABLE) when it would miss, or when it would start in a busy slot and its
first token may come up to `WAIT_STEPS` steps past its deadline (`Fate.margin_s`,
reported as that late): the wait would likely end in the same refusal, later, and a
caller is better served by the refusal now. Refusals (and spills) read the forecast
unscaled by `lateness`, and so does the prediction an `Admit` carries: a pessimistic
guess may park work, never turn a caller away or change what the caller is told. A
ticket that takes an idle slot is never refused
as SLO_UNATTAINABLE, even when its own prefill misses the target: it starts at once,
refusing it sheds no load, and its run corrects the measured figures (which nothing
else would, were every request refused). A ticket refused in the simulation takes no
slot, so tickets behind it see the room it leaves.

Spillover. A Lane may name another Lane to take the requests it cannot serve in time
(`LaneSpec.spillover`). `arrive(..., spill=True)` (the Lane names one, and it exists)
answers `Spill` instead of queueing or refusing a fresh ticket that the forecast says
misses its TTFT target: one it would refuse as SLO_UNATTAINABLE, or, under onOverload:
queue, one it would queue past its deadline (and one refused as QUEUE_FULL that would
miss it too). A ticket that can meet its target here (on an idle slot, after the work
ahead, or by preempting) stays. `Spill.local` is this Lane's own decision, which
stands if the spillover Lane refuses. The data plane then arrives the ticket on the
spillover Lane's queue with `spilled_from` set: there it is admitted only if the
forecast says it meets its target (an idle slot, or a first token by its deadline;
not with no replica to forecast from), whatever onOverload says, else refused as
SLO_UNATTAINABLE; and it never spills again, so no manifests make a cycle. Only an
arrival spills: a ticket admitted here that later misses is refused here
(`expire`), as without spillover.

Gate. `gate(policy)` asks the same question of a probe, the smallest request there is
(one prompt token, one to generate, no tenant, no session), arriving now: if even it is
refused, every fresh request of that policy is, with the same reason, until something
changes (an event; for SLO_UNATTAINABLE, also the work ahead draining by the amount
the probe misses its target by). The data plane publishes closed gates so that the
HTTP shim can refuse such requests without a round trip (`WatchAdmission`).

Caller's deadline. A ticket may carry its caller's own deadline (`caller_deadline`: a
gRPC deadline, on the clock of `now`; none over HTTP). It orders nothing. `arrive`
refuses (DEADLINE_EXCEEDED, with the predicted first token) a fresh ticket that would
wait (for a busy slot or a park) and whose first token the unscaled forecast puts
after it: its caller would be gone first. One that takes an idle slot starts, as for
a target. A fresh ticket still waiting when its caller's deadline comes is taken out
then by `expire` (`next_expiry` says when), and never starts after it, idle slot or
not; a parked generation is not (its caller leaving ends its stream, which takes it
out). No work is parked for a ticket whose expected output (its first token, then
`expected_output` tokens of decode) would end after its caller's deadline.

Retry-after, from the same forecast (how fast this Lane drains), within
[RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S]: for QUEUE_FULL, until the first ticket of the
policy leaves the queue (starts or times out); for QUEUE_TIMEOUT, until the ticket's turn
would have come; for SLO_UNATTAINABLE, until a request like it would meet the target
(predicted first token minus target, as the work ahead drains). RETRY_AFTER_UNKNOWN_S
when the forecast knows nothing. None for SLO_UNATTAINABLE when no wait helps: the
ticket's own prefill at its quickest (alone on a replica, as measured, without the start
overhead: `Fate.best_prefill_s`) takes over `NO_WAIT_HELPS_FACTOR` times its target, so
a retry would be refused the same; the refusal carries that prefill instead
(`errors.SloUnattainable.too_long`). Nearer the target the measurement's noise may
decide, and the usual hint stands.

Known simplifications: the step time is the one at the batch the queue keeps the
replica at, also for its last requests as the queue runs dry; a resume costs no time;
for a start after now, a slot counts against the cap of the policy that took it last
until another ticket takes it (a start now counts what runs now);
bytes freed by a simulated resume are not returned to the parking budget;
the prefill line holds whole prefills one after another, though an engine may put two
short prompts in one step and paces a prompt's chunks beside decoding streams; the runs
prefilling now hold it from now as one block, and a ticket starting in the slot of a
generation being parked does not hold it; an idle start still takes the least loaded
replica, not the one whose line frees first;
tickets that will arrive later are not foreseen (a more urgent arrival may push an
admitted ticket past its deadline, and `expire` then refuses it).
"""

from blazar.dataplane.admission.forecast import hinted_prompt_tokens
from blazar.dataplane.admission.queue import (
    PROBE_ID,
    PROBE_MAX_TOKENS,
    PROBE_PROMPT_TOKENS,
    LaneQueue,
)
from blazar.dataplane.admission.terms import (
    FIFO_MAX_QUEUE_DEPTH,
    FIFO_POLICY,
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    RETRY_AFTER_UNKNOWN_S,
    Admit,
    Dispatch,
    Filling,
    LaneView,
    Policy,
    Preempt,
    Reason,
    Refuse,
    ReplicaView,
    Resume,
    Running,
    Spill,
    Ticket,
    TokenRate,
    expected_output,
    fresh_tokens,
)

__all__ = [
    "FIFO_MAX_QUEUE_DEPTH",
    "FIFO_POLICY",
    "PROBE_ID",
    "PROBE_MAX_TOKENS",
    "PROBE_PROMPT_TOKENS",
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "RETRY_AFTER_UNKNOWN_S",
    "Admit",
    "Dispatch",
    "Filling",
    "LaneQueue",
    "LaneView",
    "Policy",
    "Preempt",
    "Reason",
    "Refuse",
    "ReplicaView",
    "Resume",
    "Running",
    "Spill",
    "Ticket",
    "TokenRate",
    "expected_output",
    "fresh_tokens",
    "hinted_prompt_tokens",
]
