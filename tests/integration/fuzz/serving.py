"""The one daemon every fuzz run of this package shares, and what it serves.

Starting a daemon and loading the model costs each module seconds, and the runs leave
it as they found it (that is what they check), so the package starts it once
(`conftest.daemon`, package-scoped). What it serves is sized for thousands of short
requests on a 2-core machine:

- `SLOTS` sequences, so that requests sent together are decoded in one batch, and so
  that the few prompt prefixes the runs repeat (each dialect's tool prompt, system
  turns) stay in some slot's cache instead of being prefilled again;
- `THREADS` compute threads, both cores: when the run has the machine to itself, as in
  CI, the engine's work is most of a run's time and a second thread shortens it (the
  engines share the cores by `blazar.engine.cpushare`, and the session's other daemons
  are idle meanwhile). Measured on the 2-core dev box, quiet, same draws: 400
  engine-bound requests took 31 s on 1 thread and 19 s on 2; 1,200 bodies (400 per
  dialect) 42 s and 31 s. Under other load the second thread mostly waits at llama.cpp's
  barriers instead (Anthropic's 1,000 bodies once took 284 s on 2 threads and 72 s on 1);
  run the fuzz package alone for a figure that means something;
- `CONTEXT_PER_SLOT` tokens, so that a huge prompt is refused before any prefill.
"""

from __future__ import annotations

from tests.integration.harness import Daemon

LANE = "fuzz"
# The Model the Lane serves (the bundled GGUF).
MODEL = "local"
CONTEXT_PER_SLOT = 1024
SLOTS = 8
THREADS = 2
# Bodies the body fuzz run keeps in flight: one per slot. Anthropic's 1,000 on the
# 2-core dev box, shared with other work: 124 s one at a time, 72 s four at a time
# (same load); 43 s with 4 slots and 34 s with 8 (a lighter load).
IN_FLIGHT = SLOTS


def restarts(daemon: Daemon) -> int:
    """How often the Lane's one engine has restarted so far. A run checks that its own
    requests added none: an engine start that failed before the run began is not the
    run's doing (one such was seen: SIGSEGV 2 ms after the spawn, before any request,
    about one daemon start in seven on the dev box; unexplained: see the seventeenth
    session's notes)."""
    (replica,) = daemon.get("lane", LANE)["status"]["replicaStatuses"]
    return int(replica.get("restarts", 0))
