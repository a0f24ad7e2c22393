"""Ollama's `options`, read as canonical sampling or refused by name.

Pure. Every option either does what Ollama does with it or is refused by name, never
ignored (a sampler option sent at its "off" value does what Ollama's does with it:
nothing): `sampling` reads a generation's options, `check_embedding` an embedding's
(only `num_ctx` means anything there), and `check_num_ctx` refuses a context larger
than the Lane serves per request. A smaller `num_ctx` bounds the request's context
(`Sampling.context_limit`): a prompt that does not fit is refused, and the generation
stops at its end, as at the end of the Lane's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from blazar._proto.v1 import inference_pb2
from blazar.api import errors, penalties, wire
from blazar.shim import canonical, validation

# Ollama's num_predict: -1 generates until the model stops, -2 until the context is
# full; the runner reads 0 as "no limit" too. Blazar stops at both, so all mean unset.
_UNLIMITED_PREDICT = (-2, -1, 0)

# Ollama options Blazar does not take, and why (the rest are unknown to Ollama too).
_SAMPLER_OPTIONS = frozenset(
    {
        "num_keep", "typical_p", "tfs_z", "mirostat", "mirostat_tau",
        "mirostat_eta", "penalize_newline",
    }
)  # fmt: skip
# Sampler options at the value that turns them off in Ollama's runner ask for nothing
# Blazar's sampler does not do: taken, so that clients which send every setting they
# have, defaults included, are served. Any other value is refused by name.
_OFF_VALUES = {"mirostat": 0, "typical_p": 1, "tfs_z": 1}
# Mirostat's target entropy and learning rate tune mirostat only: with it off, nothing.
_MIROSTAT_TUNING = frozenset({"mirostat_tau", "mirostat_eta"})
_LANE_OPTIONS = {
    "num_thread": "threads",
    "num_gpu": "gpuLayers",
    "num_batch": None,
    "main_gpu": None,
    "use_mmap": None,
    "use_mlock": None,
    "low_vram": None,
    "f16_kv": "kvCache",
    "vocab_only": None,
    "numa": None,
    "logits_all": None,
    # Ollama's draft tokens per step; Blazar drafts by the Lane's SpecPair.
    "draft_num_predict": "speculation, a SpecPair's draft.maxDraftTokens",
}


def sampling(options: Mapping[str, Any]) -> inference_pb2.Sampling:
    """Ollama's `options` as canonical sampling, `num_predict` a bound only
    (`max_tokens_up_to_context`), `num_ctx` the context the request may fill
    (`context_limit`; one over the Lane's is refused by `check_num_ctx`). Anything else
    is refused by name, never ignored; an option sent as null is not set (clients send
    every setting they have, set or not)."""
    options = {name: value for name, value in options.items() if value is not None}
    for name in options:
        if name not in _OPTIONS and not _turned_off(name, options):
            raise _unsupported_option(name)
    read = _OptionReader(options)
    num_predict = read.integer("num_predict", low=-2, high=wire.INT32_MAX)
    stop = options.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise validation.invalid(
            "Invalid value for 'options.stop': use a string or a list of strings.",
            param="options.stop",
        )
    context = read.integer("num_ctx", low=1, high=wire.INT32_MAX)
    penalized = _penalized(read.integer("repeat_last_n"))
    repeat_penalty = read.number("repeat_penalty", low=0, low_open=True)
    presence_penalty = read.number("presence_penalty", low=-2, high=2)
    frequency_penalty = read.number("frequency_penalty", low=-2, high=2)
    out = canonical.sampling(
        temperature=read.number("temperature", low=0),
        top_p=read.number("top_p", low=0, high=1),
        top_k=read.integer("top_k", low=0, high=wire.INT32_MAX),
        min_p=read.number("min_p", low=0, high=1),
        repeat_penalty=repeat_penalty if penalized else None,
        presence_penalty=presence_penalty if penalized else None,
        frequency_penalty=frequency_penalty if penalized else None,
        seed=read.integer("seed"),
        max_tokens=None if num_predict in (None, *_UNLIMITED_PREDICT) else num_predict,
        stop=[stop] if isinstance(stop, str) else (stop or ()),
    )
    # Ollama's num_predict caps the generation and reserves nothing: a prompt that
    # leaves less room is served, and stops where the context ends (done_reason
    # "length"), never refused for the two together as OpenAI's max_tokens is.
    out.max_tokens_up_to_context = out.HasField("max_tokens")
    if context is not None:
        # Ollama sizes the context by it: a prompt must fit in it and the generation
        # stops at its end. Blazar refuses the prompt Ollama would cut (`check_num_ctx`
        # refuses a num_ctx over the Lane's first).
        out.context_limit = context
    return out


_OPTIONS = frozenset(
    {
        "num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
        "repeat_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n",
        "num_ctx",
    }
)  # fmt: skip


def _penalized(window: int | None) -> bool:
    """Whether the penalties act, by `repeat_last_n`: Blazar's window
    (`penalties.WINDOW`, Ollama's default) or unset, yes; 0 turns them off, as in
    Ollama's runner. Another window (-1 is the whole context) is refused: Blazar's
    penalties look back over only that one."""
    if window is None or window == penalties.WINDOW:
        return True
    if window == 0:
        return False
    raise validation.invalid(
        f"'options.repeat_last_n' {window} is not supported: Blazar's penalties look back "
        f"over the last {penalties.WINDOW} tokens (send {penalties.WINDOW}, or 0 for no "
        "penalties, or omit it).",
        param="options.repeat_last_n",
    )


def is_option(name: str) -> bool:
    """Whether `name` is one of Ollama's model options (taken or refused here), which
    a client may have sent beside `options` instead of in it."""
    return name in _OPTIONS or name in _SAMPLER_OPTIONS or name in _LANE_OPTIONS


def _turned_off(name: str, options: Mapping[str, Any]) -> bool:
    """Whether the unsupported option `name` is sent at a value that asks for nothing
    (`_OFF_VALUES`, or mirostat's tuning while mirostat is off)."""
    value = options[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if name in _OFF_VALUES:
        return value == _OFF_VALUES[name]
    if name in _MIROSTAT_TUNING:
        return "mirostat" not in options or _turned_off("mirostat", options)
    return False


def _unsupported_option(name: str) -> errors.InvalidRequest:
    param = f"options.{name}"
    if name in _OFF_VALUES:
        why = f"Blazar's sampler does not have it (send {_OFF_VALUES[name]}, off, or omit it)"
    elif name in _MIROSTAT_TUNING:
        why = "Blazar's sampler has no mirostat (it is taken only with mirostat 0, off)"
    elif name in _SAMPLER_OPTIONS:
        why = "Blazar's sampler does not have it"
    elif name in _LANE_OPTIONS:
        setting = _LANE_OPTIONS[name]
        why = (
            f"it is an engine setting, which Blazar takes from the Lane ({setting})"
            if setting
            else "it is an engine setting Blazar does not take per request"
        )
    else:
        why = "it is not an option Blazar knows"
    supported = ", ".join(sorted(_OPTIONS))
    return validation.invalid(
        f"'{param}' is not supported: {why}. Supported options: {supported}.", param=param
    )


@dataclass(frozen=True)
class _OptionReader:
    options: Mapping[str, Any]

    def integer(self, name: str, *, low: int | None = None, high: int | None = None) -> int | None:
        value = self.options.get(name)
        if value is None:
            return None
        # Go decodes a whole JSON number into an int option; so does Ollama's client.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise validation.invalid(
                f"Invalid value for 'options.{name}': {value!r} is not an integer.",
                param=f"options.{name}",
            )
        self._check_range(name, value, low=low, high=high, low_open=False)
        return value

    def number(
        self,
        name: str,
        *,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
    ) -> float | None:
        value = self.options.get(name)
        if value is None:
            return None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise validation.invalid(
                f"Invalid value for 'options.{name}': {value!r} is not a number.",
                param=f"options.{name}",
            )
        self._check_range(name, value, low=low, high=high, low_open=low_open)
        return float(value)

    @staticmethod
    def _check_range(
        name: str, value: float, *, low: float | None, high: float | None, low_open: bool
    ) -> None:
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and value > high
        if below or above or not math.isfinite(value):
            bounds = []
            if low is not None:
                bounds.append(f"more than {_bound(low)}" if low_open else f"at least {_bound(low)}")
            if high is not None:
                bounds.append(f"at most {_bound(high)}")
            raise validation.invalid(
                f"Invalid value for 'options.{name}': {value!r}; it must be "
                f"{' and '.join(bounds)}.",
                param=f"options.{name}",
            )


def _bound(value: float) -> str:
    """A range's end as the caller must read it: an integer whole (`:g` would round
    INT32_MAX to 2.14748e+09, a number the caller cannot send), a fraction short."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def num_ctx(options: Mapping[str, Any] | None) -> int | None:
    """An embedding's `num_ctx` option (checked by `check_embedding`), None when not
    sent: the context its inputs must fit, as in Ollama, which cuts a longer one short
    where Blazar refuses it. A generation's is read by `sampling`."""
    value = (options or {}).get("num_ctx")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_num_ctx(requested: int, info: inference_pb2.ModelInfo) -> None:
    """A context up to the Lane's context per slot fits (every request gets that much,
    and one that asks for less is bounded by it: `sampling`); a larger one is refused,
    never silently served with less. An upstream Lane's context is the upstream's,
    unknown here: the upstream refuses what it cannot hold (and `bound_context` leaves
    the bound to it)."""
    if not info.upstream and requested > info.context_length:
        raise errors.ContextLengthExceeded(
            f"'options.num_ctx' {requested} is larger than the context Lane "
            f"'{info.lane}' serves per request (contextPerSlot {info.context_length}). Send "
            f"num_ctx {info.context_length} or less, or raise the Lane's contextPerSlot.",
            metadata={
                validation.PARAM_KEY: "options.num_ctx",
                "num_ctx": str(requested),
                "context_length": str(info.context_length),
            },
        )


def bound_context(
    bounded: inference_pb2.Sampling | inference_pb2.EmbedRequest, info: inference_pb2.ModelInfo
) -> None:
    """Check the num_ctx a generation's sampling or an embedding carries (its
    `context_limit`) against the Lane (`check_num_ctx`). An upstream Lane's server sizes
    its own context and is sent no bound, as before num_ctx bounded a local Lane's."""
    if not bounded.HasField("context_limit"):
        return
    check_num_ctx(bounded.context_limit, info)
    if info.upstream:
        bounded.ClearField("context_limit")


def check_embedding(options: Mapping[str, Any] | None) -> None:
    """An embedding has no sampling: only `num_ctx` is taken (see `check_num_ctx`)."""
    for name, value in (options or {}).items():
        if name != "num_ctx" and value is not None:
            raise validation.invalid(
                f"'options.{name}' is not supported for embeddings; only num_ctx is.",
                param=f"options.{name}",
            )
    _OptionReader(options or {}).integer("num_ctx", low=1, high=wire.INT32_MAX)
