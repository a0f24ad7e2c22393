"""Metadata keys of the engine protocol (`proto/blazar/engine/v1/engine.proto`), for
both of its sides: the engine worker that sends them (`blazar.engine.service`) and the
daemon's client that reads them (`blazar.enginehost.client`), which share no module of
their own."""

# Generate's initial metadata, sent with its first chunk: the prompt tokens the slot's
# cache held, known once the request has its slot, and the prompt's tokens in all.
PREFIX_REUSED_KEY = "blazar-prefix-reused"
PROMPT_TOKENS_KEY = "blazar-prompt-tokens"
