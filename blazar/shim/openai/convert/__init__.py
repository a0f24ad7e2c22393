"""Translation between OpenAI's wire format and the canonical `blazar.v1` messages.

Pure: no IO, no clock, no logging. One module per side of the translation:
`requests` builds canonical requests from request bodies, `render` turns generation
streams into chat and completion responses (streamed and whole), `logprob` renders
token log-probabilities in both of OpenAI's shapes, and `envelope` renders any
`BlazarError` in OpenAI's error envelope.
"""
