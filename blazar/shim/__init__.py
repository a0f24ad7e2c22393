"""The HTTP shim: speaks vendor API dialects and forwards to `blazar.v1.Inference`.

The shim is stateless. Each dialect (`openai/`, `ollama/`, `anthropic/`) parses
its vendor's wire format, converts it into the canonical proto request, calls the
daemon's public gRPC API through `inference.InferenceClient`, and renders the chunk
stream back in its own format. Dialects never import each other; what they share
(the gRPC client, request ids, body validation, building canonical requests and
collecting answers, relaying a stream, SSE and NDJSON framing) lives in this package.
"""
