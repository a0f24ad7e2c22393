"""OpenAI's Responses API (`POST /v1/responses`), the subset a stateless local server
can serve: its wire models (`protocol`), its conversion to and from the canonical
request and stream (`requests`, `render`) and its route (`routes`)."""
