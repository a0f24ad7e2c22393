"""Sampling settings of one request, and the llama.cpp sampler chain built from them.

`resolve` applies the engine's defaults to the wire `Sampling` and `Constraint` and
validates them (a JSON schema becomes a GBNF grammar by `schema.grammar`); `build_sampler` turns the
result into native `llama_sampler`s, so sampling over the 262k-token vocabulary happens
in C (logits reach numpy only to hand a grammar-constrained draw its candidates).

`resolve` is pure unless it is given a `Vocabulary`: then it also checks token ids
against the vocabulary and has llama.cpp compile the grammar once, so that a bad
grammar is an INVALID_ARGUMENT for the caller and never a NULL sampler in the decode
thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from blazar import logs
from blazar._proto.v1 import inference_pb2
from blazar.api import errors, jsontext, penalties
from blazar.engine import gbnf, schema

# OpenAI's limit, and what the loop is sized for.
MAX_TOP_LOGPROBS = 20
# Stop strings are matched against the text after every token, on the thread every
# slot shares: 40,000 of them took 68 ms a token. OpenAI takes 4, llama.cpp any number.
MAX_STOPS = 64
# A bias at or below this bans the token (OpenAI's convention); llama.cpp wants -inf.
BAN_BIAS = -100.0
GRAMMAR_ROOT = "root"
# Temperatures below this sample greedily. Any logit gap over 1e-4 already gives odds
# under e^-100 there, while dividing logits by a much smaller float32 (1e-45, say)
# overflows to infinity and breaks the softmax.
GREEDY_BELOW = 1e-6


# A grammar's pass over the whole vocabulary (when it rejects the token the chain drew)
# that takes longer than this ends its request. Static bounds (`gbnf`) refuse the forms
# known to be hopeless before any work; this one catches the rest at their first slow
# step: 200 optional items in a row cost 11 s per token on the 2-core dev box, while the
# largest grammar the bounds allow in width (256 alternatives) cost 3.0 s there, loaded.
MAX_GRAMMAR_PASS_S = 10.0
# The best tokens by logit the grammar judges first when the chain's draw is rejected
# (`Sampler`), before the whole vocabulary.
GRAMMAR_SLICES = (256, 4096)


# Room left for float32 arithmetic in llama.cpp's top-p and min-p stages against the
# float64 here (`slice_decides`): a decision within it falls back to the whole pass.
_CUT_MARGIN = 1e-3


def slice_decides(
    allowed: Sequence[float] | Any, boundary: float, *, keep: int, top_p: float, min_p: float
) -> bool:
    """Whether the chain (top-k `keep`, then top-p, then min-p, on raw logits, then
    temperature and the draw) keeps the same tokens from a slice of the best logits, the
    grammar applied, as from the whole vocabulary: then its draw from the slice is its
    draw from the whole (`Sampler._constrained_draw`), and no pass over the rest is needed.

    `allowed`: the logits the grammar allows in the slice, best first; `boundary`: the
    slice's lowest logit, which every token outside it is at or below. With `keep` of
    them allowed, top-k keeps only slice tokens. With fewer, up to keep - n allowed
    tokens outside could join; min-p drops each (its logit is at most `boundary`) when
    `boundary` is below the best logit + ln(min_p). Those tokens' weight can only move
    top-p's cut later: it keeps at least the tokens it keeps with none outside, and
    whatever it keeps beyond those, min-p must drop too."""
    n = len(allowed)
    if n >= keep:
        return True
    if n == 0 or min_p <= 0.0:
        return False
    best = float(allowed[0])
    threshold = best + math.log(min_p)
    if not boundary < threshold - _CUT_MARGIN:
        return False
    if top_p >= 1.0:
        return True
    weights = [math.exp(float(logit) - best) for logit in allowed]
    inside = sum(weights)
    # The fewest tokens top-p can keep: with no weight outside its sums run highest,
    # and llama.cpp's float32 sums may run a little higher still.
    fewest, running = n, 0.0
    for i, weight in enumerate(weights):
        running += weight
        if running / inside >= top_p - _CUT_MARGIN:
            fewest = i + 1
            break
    # Whatever top-p keeps past `fewest` (slice tokens, then outside ones) min-p drops.
    return fewest >= n or float(allowed[fewest]) < threshold - _CUT_MARGIN


class Vocabulary(Protocol):
    """The loaded model's vocabulary, as far as sampling needs it."""

    @property
    def n_tokens(self) -> int: ...

    @property
    def handle(self) -> Any:
        """The native `llama_vocab *` (valid while the model is loaded)."""
        ...

    @property
    def end_of_generation(self) -> frozenset[int]:
        """The tokens a generation ends on (Gemma 3: <eos>, <end_of_turn>, </s>)."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    # None: generate until the slot's context is full.
    max_tokens: int | None = None
    # max_tokens bounds the generation but reserves no context: a prompt that leaves
    # less room is served up to the context's end (`text.generation_room`).
    max_tokens_up_to_context: bool = False
    # The context the request may fill, when it asks for less than a slot's
    # (Sampling.context_limit, Ollama's num_ctx); None: the slot's.
    context_limit: int | None = None
    stop: tuple[str, ...] = ()
    # (token id, bias) sorted by id; a bias <= BAN_BIAS bans the token.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # GBNF text with a `root` rule; None leaves the output unconstrained.
    grammar: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    # Needed by the grammar stage (set by `resolve` when given a vocabulary).
    vocab: Vocabulary | None = field(default=None, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return (self.repeat_penalty, self.presence_penalty, self.frequency_penalty) != (
            1.0,
            0.0,
            0.0,
        )

    @property
    def constrained(self) -> bool:
        return self.grammar is not None


# The request field (`errors.FIELD_KEY`) blamed when only the logit bias is invalid.
LOGIT_BIAS_FIELD = "sampling.logit_bias"
STOP_FIELD = "sampling.stop"
CONSTRAINT_FIELD = "constraint"


# llama.cpp's dist sampler reads this seed as "draw a random one" (LLAMA_DEFAULT_SEED).
RANDOM_SEED = 0xFFFFFFFF


def native_seed(seed: int) -> int:
    """The seed llama.cpp is given for a caller's explicit `seed`.

    An explicit seed must repeat its output, so the one value llama.cpp takes as
    "random" is moved to its neighbour: seeds 2**32 - 1 and 2**32 - 2 give the same
    stream, as two of 2**32 seeds must somewhere.
    """
    return RANDOM_SEED - 1 if seed == RANDOM_SEED else seed


def resolve(
    sampling: inference_pb2.Sampling,
    *,
    seed: int | None = None,
    constraint: inference_pb2.Constraint | None = None,
    vocab: Vocabulary | None = None,
) -> SamplingParams:
    """Fill unset fields with the defaults; raise InvalidRequest for impossible values.

    `seed` stands in for an unset `sampling.seed` (tests pass one; by default a fresh
    random seed is drawn). `constraint` becomes `grammar`. With `vocab`, token ids are
    checked against it and the grammar is compiled once by llama.cpp (see module doc).
    """
    d = SamplingParams()
    with _blaming(CONSTRAINT_FIELD):
        grammar = grammar_of(constraint) if constraint is not None else None
    p = SamplingParams(
        temperature=sampling.temperature if sampling.HasField("temperature") else d.temperature,
        top_k=sampling.top_k if sampling.HasField("top_k") else d.top_k,
        top_p=sampling.top_p if sampling.HasField("top_p") else d.top_p,
        min_p=sampling.min_p if sampling.HasField("min_p") else d.min_p,
        repeat_penalty=(
            sampling.repeat_penalty if sampling.HasField("repeat_penalty") else d.repeat_penalty
        ),
        presence_penalty=(
            sampling.presence_penalty
            if sampling.HasField("presence_penalty")
            else d.presence_penalty
        ),
        frequency_penalty=(
            sampling.frequency_penalty
            if sampling.HasField("frequency_penalty")
            else d.frequency_penalty
        ),
        seed=(
            native_seed(sampling.seed)
            if sampling.HasField("seed")
            else (secrets.randbits(32) if seed is None else seed)
        ),
        max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else None,
        max_tokens_up_to_context=sampling.max_tokens_up_to_context,
        context_limit=sampling.context_limit or None,
        stop=tuple(sampling.stop),
        logit_bias=_bias(sampling, vocab),
        grammar=grammar,
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
        vocab=vocab,
    )
    if len(p.stop) > MAX_STOPS:
        raise errors.InvalidRequest(
            f"Invalid sampling: at most {MAX_STOPS} stop strings are accepted; got {len(p.stop)}.",
            metadata={errors.FIELD_KEY: STOP_FIELD},
        )
    n_vocab = vocab.n_tokens if vocab is not None else None
    bad_ids = [t for t, _ in p.logit_bias if t < 0 or (n_vocab is not None and t >= n_vocab)]
    problems = [
        msg
        for bad, msg in (
            # Written so that NaN fails too (every comparison with NaN is False).
            (not 0 <= p.temperature < math.inf, "temperature must be a number >= 0"),
            (p.top_k < 0, "top_k must be >= 0"),
            (not 0.0 <= p.top_p <= 1.0, "top_p must be between 0 and 1"),
            (not 0.0 <= p.min_p <= 1.0, "min_p must be between 0 and 1"),
            (not 0 < p.repeat_penalty < math.inf, "repeat_penalty must be a number > 0"),
            (not math.isfinite(p.presence_penalty), "presence_penalty must be a number"),
            (not math.isfinite(p.frequency_penalty), "frequency_penalty must be a number"),
            (p.max_tokens is not None and p.max_tokens < 1, "max_tokens must be >= 1"),
            (
                not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS,
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
            ),
            (
                p.top_logprobs > 0 and not (p.logprobs or p.prompt_logprobs),
                "top_logprobs needs logprobs or prompt_logprobs",
            ),
        )
        if bad
    ]
    bias_problems = [
        msg
        for bad, msg in (
            (
                bool(bad_ids),
                f"logit_bias names token ids outside the vocabulary"
                f"{f' of {n_vocab} tokens' if n_vocab is not None else ''}: "
                + ", ".join(str(t) for t in bad_ids[:5]),
            ),
            (
                any(math.isnan(b) for _, b in p.logit_bias),
                "logit_bias values must be numbers",
            ),
        )
        if bad
    ]
    if problems or bias_problems:
        err = errors.InvalidRequest(
            "Invalid sampling: " + "; ".join(problems + bias_problems) + "."
        )
        if not problems:
            # Only the vocabulary knows these ids are wrong, so only the engine can say
            # so; naming the field lets each dialect blame its own parameter.
            err.metadata[errors.FIELD_KEY] = LOGIT_BIAS_FIELD
        raise err
    if grammar is not None and vocab is not None:
        from_schema = constraint is not None and constraint.WhichOneof("kind") == "json_schema"
        with _blaming(CONSTRAINT_FIELD):
            check_grammar(grammar, vocab, from_schema=from_schema)
    return p


def _bias(
    sampling: inference_pb2.Sampling, vocab: Vocabulary | None
) -> tuple[tuple[int, float], ...]:
    """The request's logit bias, sorted by token id; with `ignore_eos`, every
    end-of-generation token banned (whatever bias the request gave it)."""
    bias = dict(sampling.logit_bias)
    if sampling.ignore_eos:
        if vocab is None:
            raise ValueError("ignore_eos needs the vocabulary: resolve(vocab=...)")
        bias.update(dict.fromkeys(vocab.end_of_generation, BAN_BIAS))
    return tuple(sorted(bias.items()))


@contextlib.contextmanager
def _blaming(field: str) -> Iterator[None]:
    """Name `field` as the one at fault in the InvalidRequest raised inside."""
    try:
        yield
    except errors.InvalidRequest as err:
        err.metadata.setdefault(errors.FIELD_KEY, field)
        raise


def grammar_of(constraint: inference_pb2.Constraint) -> str | None:
    """The GBNF grammar a constraint stands for (None when it constrains nothing).

    Raises InvalidRequest when a JSON schema is not JSON, not an object, or uses a
    feature the converter cannot express.
    """
    kind = constraint.WhichOneof("kind")
    if kind == "grammar":
        gbnf.check_bounds(constraint.grammar)
        if GRAMMAR_ROOT not in constraint.grammar:
            raise errors.InvalidRequest(
                f"The grammar has no '{GRAMMAR_ROOT}' rule; GBNF output starts at "
                f"'{GRAMMAR_ROOT} ::= ...'."
            )
        return constraint.grammar
    if kind == "json_object":
        return schema.grammar({"type": "object"}) if constraint.json_object else None
    if kind == "json_schema":
        try:
            document = jsontext.loads(constraint.json_schema, whole_characters=True)
            if not isinstance(document, dict):
                raise errors.InvalidRequest(
                    f"The JSON schema must be a JSON object, not {type(document).__name__}."
                )
            made = schema.grammar(document)
            gbnf.check_bounds(made, what="The grammar made from the JSON schema")
            return made
        except jsontext.NotJSON as exc:
            raise errors.InvalidRequest(f"The JSON schema is not valid JSON: {exc}.") from None
        except RecursionError:
            # Python's JSON encoder recurses once per level.
            raise errors.InvalidRequest(
                "The JSON schema cannot be turned into a grammar: it nests too deeply."
            ) from None
    return None


def check_grammar(grammar: str, vocab: Vocabulary, *, from_schema: bool = False) -> None:
    """Have llama.cpp parse the grammar; InvalidRequest when it refuses.

    `from_schema`: the grammar was made from the caller's JSON schema, so the message
    speaks of the schema, not of GBNF they never wrote.
    """
    import llama_cpp as lc

    # A grammar llama.cpp cannot parse is printed whole to stderr, the engine's log:
    # it is the caller's text (a forced answer, a schema's names), not the log's.
    with logs.native_stderr_muted():
        sampler = lc.llama_sampler_init_grammar(
            vocab.handle, grammar.encode(), GRAMMAR_ROOT.encode()
        )
    if not sampler and from_schema:
        raise errors.InvalidRequest(
            "The JSON schema cannot be turned into a grammar llama.cpp accepts: most "
            "likely a pattern repeats a group that can match nothing, such as '(a|)*', "
            "or repeats something over 10,000 times."
        )
    if not sampler:
        raise errors.InvalidRequest(
            "The grammar is not valid GBNF: llama.cpp could not parse it (an undefined "
            "rule, a syntax error, a missing 'root' rule or left recursion)."
        )
    lc.llama_sampler_free(sampler)


class Sampler:
    """A request's native samplers: the chain, and its grammar kept apart from it.

    The grammar is checked against the token the chain draws and applied to the whole
    vocabulary only when it rejects that token, as llama.cpp's common sampler does:
    a grammar pass over all 262k tokens cost about 45 ms per token here (measured 17-20
    against 94 tok/s greedy), while most drawn tokens are already in the language.
    Sampling in the fallback applies the grammar first, then the chain, so nothing
    outside the language is ever emitted. Decode thread only; `free` exactly once.

    The fallback judges the best tokens first when the chain keeps only the `keep` best
    allowed ones (greedy: 1; top-k: k) and sees the logits as they are (no bias, no
    penalties): the grammar judges the best `GRAMMAR_SLICES[0]` by logit, then the best
    `GRAMMAR_SLICES[1]`, and once `keep` of them are allowed the chain draws from them.
    Every token not judged ranks below those `keep`, so the chain keeps the same ones
    and draws the same token (one random draw either way) as after a pass over the
    whole vocabulary, which is what it falls back to when the slices hold too few.
    Measured on the tools Lane's forced calls: the whole-vocabulary pass cost 34 ms
    and came at one token in five. With fewer than `keep` allowed in a slice, the
    chain's min-p (0.05 by default) may still prove that no token outside the slice
    can be drawn (`slice_decides`): the bundled model's forced named call, 31 tokens
    at temperature 0.6 and the default top-k, top-p and min-p, took 0.89-0.93 s
    against 1.21-1.38 s before, and four at once 4.1-4.3 s against 5.4-6.6 s.

    Plain greedy decoding (no penalties, no grammar, no bias but bans) has no chain at
    all: the token is the logits row's argmax, taken in place, with banned tokens set
    to -inf in the row first. llama.cpp's sampler copies the row into a 262k-entry
    candidate array first: 0.47 ms per token against 0.04 ms for the argmax (same
    token, the first maximum), 3.4 ms of every 8-stream step.
    """

    def __init__(
        self,
        chain: Any | None,
        grammar: Any | None,
        n_vocab: int,
        *,
        biased: bool = False,
        banned: Sequence[int] = (),
        keep: int | None = None,
        top_p: float = 1.0,
        min_p: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        import numpy as np

        if chain is None and (grammar is not None or n_vocab <= 0):
            raise ValueError("an argmax sampler takes no grammar and needs the vocabulary size")
        if chain is not None and banned:
            raise ValueError("a chain applies its bans itself (the logit-bias stage)")
        self.chain = chain
        self._grammar = grammar
        self._n_vocab = n_vocab
        self._biased = biased
        self._keep = keep if grammar is not None else None
        # The chain's top-p and min-p stages, which `slice_decides` reads with `keep`.
        self._top_p = top_p
        self._min_p = min_p
        self._clock = clock
        # Candidates the grammar judged in its fallback passes (all of them: n_vocab).
        self.judged = 0
        # Argmax only: token ids whose logits are set to -inf before the argmax.
        self._banned = np.asarray(banned, dtype=np.intp)
        self._candidates: Any = None
        if grammar is not None:
            import llama_cpp as lc

            dtype = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
            assert dtype.itemsize == ctypes.sizeof(lc.llama_token_data)
            self._candidates = np.zeros(n_vocab, dtype=dtype)
            self._ids = np.arange(n_vocab, dtype=np.int32)

    def sample(self, ctx: Any, index: int) -> int:
        """Draw (and accept) a token from the logits of batch entry `index`."""
        import llama_cpp as lc

        if self.chain is None:
            import numpy as np

            ptr = lc.llama_get_logits_ith(ctx, index)
            if not ptr:
                raise RuntimeError(f"no logits for batch entry {index}")
            row = np.ctypeslib.as_array(ptr, (self._n_vocab,))
            if self._banned.size:
                # In the context's own buffer: the raw row for logprobs was copied
                # before sampling, and nothing reads this row after it.
                row[self._banned] = -np.inf
            token = int(row.argmax())
            if row[token] == -np.inf:
                raise errors.InvalidRequest(
                    "The logit bias bans every token of the vocabulary.",
                    metadata={errors.FIELD_KEY: LOGIT_BIAS_FIELD},
                )
            return token
        if self._grammar is None:
            return int(lc.llama_sampler_sample(self.chain, ctx, index))
        token = self._draw(ctx, index, grammar_first=False)
        if not self._allows(token):
            started = self._clock()
            token = self._constrained_draw(ctx, index)
            spent = self._clock() - started
            if spent > MAX_GRAMMAR_PASS_S:
                # The next pass would cost as much, on the decode thread every stream of
                # the engine shares: this request ends here, the others go on.
                raise errors.InvalidRequest(
                    f"The grammar (or JSON schema) took {spent:.1f} s to constrain one "
                    f"token; at most {MAX_GRAMMAR_PASS_S:.0f} s are allowed. It keeps too "
                    "many ways open at once (many optional parts in a row, say): write "
                    "it with fewer optional or repeated parts.",
                    metadata={errors.FIELD_KEY: CONSTRAINT_FIELD},
                )
            # The chain can remove every token the grammar allows (a logit bias that
            # bans them all), or the grammar allows none the vocabulary can spell
            # ('root ::= "\\x00"'); the pick is then one the grammar rejected, and
            # accepting that aborts the whole process inside llama.cpp.
            if not self._allows(token):
                raise self._contradiction()
        lc.llama_sampler_accept(self._grammar, token)
        lc.llama_sampler_accept(self.chain, token)
        return token

    def _contradiction(self) -> errors.InvalidRequest:
        if self._biased:
            return errors.InvalidRequest(
                "The logit bias bans every token the grammar (or JSON schema) allows "
                "next, so no output can satisfy both.",
                metadata={errors.FIELD_KEY: LOGIT_BIAS_FIELD},
            )
        return errors.InvalidRequest(
            "The grammar (or JSON schema) allows nothing next that this model's "
            "vocabulary can write, so no output can satisfy it.",
            metadata={errors.FIELD_KEY: CONSTRAINT_FIELD},
        )

    def _allows(self, token: int) -> bool:
        """Whether the grammar, in its current state, accepts `token` next."""
        import llama_cpp as lc

        single = lc.llama_token_data(token, 1.0, 0.0)
        one = lc.llama_token_data_array(ctypes.pointer(single), 1, -1, False)
        lc.llama_sampler_apply(self._grammar, ctypes.byref(one))
        return bool(single.logit != -math.inf)

    def _constrained_draw(self, ctx: Any, index: int) -> int:
        """The chain's draw among the tokens the grammar allows (see the class doc)."""
        import llama_cpp as lc
        import numpy as np

        keep = self._keep
        if keep is not None and keep <= GRAMMAR_SLICES[-1] < self._n_vocab:
            ptr = lc.llama_get_logits_ith(ctx, index)
            row = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            widest = GRAMMAR_SLICES[-1]
            best = np.argpartition(row, self._n_vocab - widest)[-widest:]
            best = best[np.argsort(row[best], kind="stable")[::-1]]  # best first
            for size in GRAMMAR_SLICES:
                arr = self._candidate_array(best[:size], row[best[:size]])
                lc.llama_sampler_apply(self._grammar, ctypes.byref(arr))
                self.judged += size
                logits = self._candidates[:size]["logit"]
                allowed = logits[logits != -np.inf]  # best first, as `best` is
                if slice_decides(
                    allowed,
                    float(row[best[size - 1]]),
                    keep=keep,
                    top_p=self._top_p,
                    min_p=self._min_p,
                ):
                    return self._chain_pick(arr)
        self.judged += self._n_vocab
        return self._draw(ctx, index, grammar_first=True)

    def _draw(self, ctx: Any, index: int, *, grammar_first: bool) -> int:
        import llama_cpp as lc
        import numpy as np

        ptr = lc.llama_get_logits_ith(ctx, index)
        arr = self._candidate_array(self._ids, np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)))
        if grammar_first:
            lc.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        return self._chain_pick(arr)

    def _candidate_array(self, ids: Any, logits: Any) -> Any:
        """The first len(ids) candidates, filled, as a native `llama_token_data_array`."""
        import llama_cpp as lc

        cand = self._candidates[: len(ids)]
        cand["id"] = ids
        cand["logit"] = logits
        cand["p"] = 0.0
        data = cand.ctypes.data_as(ctypes.POINTER(lc.llama_token_data))
        return lc.llama_token_data_array(data, len(ids), -1, False)

    def _chain_pick(self, arr: Any) -> int:
        """The token the chain draws from the candidates."""
        import llama_cpp as lc

        lc.llama_sampler_apply(self.chain, ctypes.byref(arr))
        if arr.selected < 0:
            raise RuntimeError("the sampler chain selected no token")
        return int(arr.data[arr.selected].id)

    def free(self) -> None:
        import llama_cpp as lc

        if self.chain is not None:
            lc.llama_sampler_free(self.chain)
        if self._grammar is not None:
            lc.llama_sampler_free(self._grammar)


def build_sampler(params: SamplingParams, *, prompt: Sequence[int] = ()) -> Sampler:
    """The native samplers for one request (the caller calls `Sampler.free`).

    The chain: logit bias, then llama.cpp's common order: penalties, top-k, top-p,
    min-p, temperature and the random draw; temperature 0 ends in greedy instead. The
    grammar, when there is one, stays outside the chain (see `Sampler`); the model's
    end-of-generation token is allowed exactly when the grammar is complete.

    `prompt` primes the penalties stage with the prompt's last tokens, as llama.cpp's
    server does. Never accept prompt tokens into the grammar: it aborts the process on
    a token its language does not allow.
    """
    import llama_cpp as lc

    vocab = params.vocab
    if vocab is None and (params.grammar is not None or params.logit_bias):
        raise ValueError("a grammar or logit bias needs the vocabulary: resolve(vocab=...)")
    bans_only = all(bias <= BAN_BIAS for _, bias in params.logit_bias)
    plain = params.grammar is None and bans_only and not params.penalized
    if params.greedy and plain and vocab is not None:
        return Sampler(None, None, vocab.n_tokens, banned=[t for t, _ in params.logit_bias])
    grammar = None
    if params.grammar is not None:
        assert vocab is not None
        grammar = lc.llama_sampler_init_grammar(
            vocab.handle, params.grammar.encode(), GRAMMAR_ROOT.encode()
        )
        if not grammar:
            raise ValueError("llama.cpp rejected the grammar")
    stages: list[Any] = []
    if params.logit_bias:
        assert vocab is not None
        biases = (lc.llama_logit_bias * len(params.logit_bias))(
            *(
                lc.llama_logit_bias(token, -math.inf if bias <= BAN_BIAS else bias)
                for token, bias in params.logit_bias
            )
        )
        stages.append(
            lc.llama_sampler_init_logit_bias(vocab.n_tokens, len(params.logit_bias), biases)
        )
    if params.penalized:
        # llama-cpp-python 0.3.36 still declares the old signature with a leading
        # n_vocab; the library's function takes (last_n, repeat, freq, present). Ints
        # and floats travel in separate registers, so the C side reads the first int
        # as last_n and the floats correctly: pass last_n in both int positions.
        penalizer = lc.llama_sampler_init_penalties(
            penalties.WINDOW,
            penalties.WINDOW,
            params.repeat_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
        for token in prompt[-penalties.WINDOW :]:
            lc.llama_sampler_accept(penalizer, token)
        stages.append(penalizer)
    if params.greedy:
        stages.append(lc.llama_sampler_init_greedy())
    else:
        if params.top_k > 0:
            stages.append(lc.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            stages.append(lc.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            stages.append(lc.llama_sampler_init_min_p(params.min_p, 1))
        stages.append(lc.llama_sampler_init_temp(params.temperature))
        stages.append(lc.llama_sampler_init_dist(params.seed))
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for stage in stages:
        lc.llama_sampler_chain_add(chain, stage)  # the chain takes ownership
    n_vocab = vocab.n_tokens if vocab is not None else 0
    # How many of the best allowed tokens the chain keeps, when it sees the logits as
    # they are: what lets the grammar judge the best ones first (`Sampler`).
    keep = None
    if not params.logit_bias and not params.penalized:
        keep = 1 if params.greedy else (params.top_k if params.top_k > 0 else None)
    return Sampler(
        chain,
        grammar,
        n_vocab,
        biased=bool(params.logit_bias),
        keep=keep,
        top_p=params.top_p,
        min_p=params.min_p,
    )
