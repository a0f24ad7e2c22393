"""The controller's Prometheus metrics: how often each kind is reconciled, and how."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RECONCILES = Counter(
    "blazar_reconciles_total",
    "Reconcile passes, by kind and result (ok, retry: a temporary error, error: a bug).",
    ["kind", "result"],
)
RECONCILE_SECONDS = Histogram(
    "blazar_reconcile_seconds",
    "Time one reconcile pass took, by kind.",
    ["kind"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0),
)
RESYNCS = Counter("blazar_resyncs_total", "Periodic resyncs: every stored object queued again.")
