"""Bounds of the protobuf scalars the public API carries its numbers in: what every
dialect checks a caller's numbers against, and what a number reported to Blazar must
fit before it is put on the wire."""

# The largest value of a proto3 int32 (max_tokens, top_k, token ids, usage counts).
INT32_MAX = 2**31 - 1
