"""The one daemon every fuzz run of this package shares, and what it serves.

Starting a daemon and loading the model costs each module seconds, and the runs leave
it as they found it (that is what they check), so the package starts it once
(`conftest.daemon`, package-scoped). What it serves is sized for thousands of short
requests on a 2-core machine:

- `SLOTS` sequences, so that requests sent together are decoded in one batch, and so
  that the few prompt prefixes the runs repeat (each dialect's tool prompt, system
  turns) stay in some slot's cache instead of being prefilled again;
- `THREADS` compute thread: llama.cpp's threads meet at a barrier after every
  operation, and on cores shared with the daemon, the test process and anything else
  running, a second thread mostly waits there (see `blazar.engine.cpushare`):
  Anthropic's 1,000 bodies took 284 s on 2 threads and 72 s on 1, under the same load;
- `CONTEXT_PER_SLOT` tokens, so that a huge prompt is refused before any prefill.
"""

from __future__ import annotations

LANE = "fuzz"
# The Model the Lane serves (the bundled GGUF).
MODEL = "local"
CONTEXT_PER_SLOT = 1024
SLOTS = 8
THREADS = 1
# Bodies the body fuzz run keeps in flight: one per slot. Anthropic's 1,000 on the
# 2-core dev box, shared with other work: 124 s one at a time, 72 s four at a time
# (same load); 43 s with 4 slots and 34 s with 8 (a lighter load).
IN_FLIGHT = SLOTS
