"""`python -m blazar.engine`: parse the command line, run one engine worker."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from blazar.engine import llama, worker


def parse_args(argv: Sequence[str] | None = None) -> worker.WorkerConfig:
    p = argparse.ArgumentParser(
        prog="python -m blazar.engine",
        description="Serve one llama.cpp model as a blazar.engine.v1.Engine on a Unix socket.",
    )
    p.add_argument("--model", required=True, help="path of the GGUF file")
    p.add_argument("--socket", required=True, help="Unix socket path to serve on")
    p.add_argument("--slots", type=int, default=1, help="parallel sequences (default 1)")
    p.add_argument("--context-per-slot", type=int, default=4096, help="context tokens per slot")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for decode and prefill")
    p.add_argument("--gpu-layers", type=int, default=0, help="layers to offload to a GPU")
    p.add_argument("--parent-pid", type=int, default=None, help="exit if this is not our parent")
    template = p.add_mutually_exclusive_group()
    template.add_argument(
        "--chat-template",
        default=None,
        help="chat template overriding the GGUF's: a name (gemma, chatml, llama3) or Jinja",
    )
    template.add_argument(
        "--chat-template-file",
        default=None,
        metavar="PATH",
        help="read --chat-template's value from this UTF-8 file (for values too long to pass)",
    )
    p.add_argument(
        "--log-json", action="store_true", default=None, help="log one JSON object per line"
    )
    cache_types = sorted(llama.CACHE_TYPES)
    p.add_argument("--type-k", default="f16", choices=cache_types, help="K cache type")
    p.add_argument("--type-v", default="f16", choices=cache_types, help="V cache type")
    p.add_argument(
        "--kv-persist",
        default=None,
        metavar="DIR",
        help="save slot caches here on graceful stop and restore them on start",
    )
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--spec-kind", choices=[k.value for k in worker.SpecKind], default=None)
    spec.add_argument("--spec-ngram-size", type=int, default=3)
    spec.add_argument("--spec-max-draft", type=int, default=8)
    spec.add_argument("--spec-draft-model", default=None, metavar="PATH")
    spec.add_argument("--spec-disable-above-batch", type=int, default=4)
    spec.add_argument("--spec-min-acceptance", type=float, default=0.3)
    a = p.parse_args(argv)
    for name in ("slots", "context_per_slot", "threads", "spec_ngram_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.spec_max_draft < 0 or not 0.0 <= a.spec_min_acceptance <= 1.0:
        p.error("--spec-max-draft must be >= 0 and --spec-min-acceptance between 0 and 1")
    chat_template = a.chat_template
    if a.chat_template_file is not None:
        try:
            chat_template = Path(a.chat_template_file).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            p.error(f"--chat-template-file: {exc}")
    speculation = (
        worker.SpeculationConfig(
            kind=worker.SpecKind(a.spec_kind),
            ngram_size=a.spec_ngram_size,
            max_draft=a.spec_max_draft,
            draft_model=a.spec_draft_model,
            disable_above_batch=a.spec_disable_above_batch,
            min_acceptance=a.spec_min_acceptance,
        )
        if a.spec_kind
        else None
    )
    return worker.WorkerConfig(
        model=a.model,
        socket=a.socket,
        slots=a.slots,
        context_per_slot=a.context_per_slot,
        threads=a.threads,
        gpu_layers=a.gpu_layers,
        parent_pid=a.parent_pid,
        chat_template=chat_template,
        log_json=a.log_json,
        type_k=a.type_k,
        type_v=a.type_v,
        kv_persist=a.kv_persist,
        speculation=speculation,
    )


if __name__ == "__main__":
    sys.exit(worker.main(parse_args()))
