"""Blazar: a local LLM inference controller."""

import os

# gRPC's fork support restarts its event-engine threads in a forked child, and one of
# them can crash there (SIGSEGV in cygrpc, thread `event_engine`, seen in the kernel
# log) before the child's exec: about one engine start in six on the 2-core dev box died
# so, 2 ms after the daemon's spawn. Blazar forks only to exec (engines, the daemon, the
# CLI in tests), which needs none of it. Set before any gRPC import; a caller's own
# setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
