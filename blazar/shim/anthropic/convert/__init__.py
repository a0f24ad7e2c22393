"""Translation between Anthropic's Messages API and the canonical `blazar.v1` messages.

Pure: no IO, no clock, no logging. One module per side of the translation, as in
`blazar.shim.openai.convert`: `requests` builds canonical requests from request
bodies, `render` turns generation streams into messages (streamed and whole) and
token counts, and `envelope` renders any `BlazarError` in Anthropic's error envelope.
"""
