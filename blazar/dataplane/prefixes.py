"""Pure: an approximate index of which replica's KV cache holds which prompt prefix.

The data plane never sees tokens (engines tokenize), so, as llm-d's and SGLang's
routers do, it works on the request's text. The text (a prompt, or a canonical
serialization of a conversation: role and content of each turn, in order, so that a
conversation's next turn has its earlier turns as a prefix) is cut into blocks of
`BLOCK_CHARS` characters, and each full block gets a chain hash that covers every block
before it too: two prompts share block i's hash only if they share the first
(i + 1) x BLOCK_CHARS characters. A partial last block is not hashed.

`PrefixIndex` (one per Lane) remembers, per replica, the block hashes of the prompts
that replica served, and tells how many leading blocks of a new prompt each replica
holds. It is bounded per replica by what the replica's KV cache can hold
(`capacity`), least recently used blocks going first; recency is the order of
insertion, not a clock. A replica that restarted or left starts over (`forget`).

Each tenant has its own view (`scoped`): a prompt's hashes are mixed with its cache
scope, so that no tenant's request is routed by what another tenant's prompts left in
a replica's cache.

No IO, no clock, no logging.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

# ~32 tokens of English at ~4 characters per token: fine enough that a conversation's
# follow-up matches all but the last partial block of what was cached, coarse enough
# that a prompt filling a 32k-token context is ~1,000 hashes (under a millisecond).
BLOCK_CHARS = 128
# The usual rule of thumb for English text and code with a SentencePiece/BPE vocabulary.
CHARS_PER_TOKEN = 4

_CHAT = b"blazar-chat"
_PROMPT = b"blazar-prompt"


def capacity(*, slots: int, context_per_slot: int) -> int:
    """Blocks a replica's index keeps: what its KV cache holds (slots x context per slot
    tokens), at CHARS_PER_TOKEN characters a token. A replica cannot hold more of any
    prompt, so no request needs more blocks hashed either."""
    return max(1, slots * context_per_slot * CHARS_PER_TOKEN // BLOCK_CHARS)


def prompt_hashes(prompt: str, *, limit: int) -> tuple[int, ...]:
    """Chain hashes of a raw prompt's first `limit` full blocks."""
    return _hashes(prompt[: limit * BLOCK_CHARS], person=_PROMPT)


def chat_hashes(turns: Iterable[tuple[str, str]], *, limit: int) -> tuple[int, ...]:
    """Chain hashes of a conversation's first `limit` full blocks; `turns` are
    (role, content) pairs in order. Each turn is written length-prefixed, so no
    content can imitate a turn boundary, and a turn's text never depends on the turns
    after it."""
    wanted = limit * BLOCK_CHARS
    parts: list[str] = []
    size = 0
    for role, content in turns:
        if size >= wanted:
            break
        part = f"{len(role)}:{role}{len(content)}:{content}"
        parts.append(part)
        size += len(part)
    return _hashes("".join(parts)[:wanted], person=_CHAT)


def _hashes(text: str, *, person: bytes) -> tuple[int, ...]:
    # One running hash over the text: its digest at the end of block i covers blocks
    # 0..i. A chat and a raw prompt never share a hash (different `person`), since the
    # engine tokenizes them differently (the chat template).
    running = hashlib.blake2b(digest_size=8, person=person)
    out = []
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        running.update(text[start : start + BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        out.append(int.from_bytes(running.copy().digest(), "big"))
    return tuple(out)


def scoped(hashes: Sequence[int], scope: str) -> tuple[int, ...]:
    """`hashes` as one cache scope (a tenant) sees them: each mixed with the scope, so
    that the same prompt of two scopes shares no block, while one scope's chain (block
    i covering blocks 0..i) stays a chain. "" is the shared scope: unchanged."""
    if not scope:
        return tuple(hashes)
    key = hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=32).digest()
    return tuple(
        int.from_bytes(
            hashlib.blake2b(h.to_bytes(8, "big"), digest_size=8, key=key).digest(), "big"
        )
        for h in hashes
    )


class PrefixIndex:
    """Per replica, the block hashes of the prompts it served, most recent last.

    Bounded at `capacity` blocks per replica, dropping the least recently served first.
    A prompt's blocks are recorded last block first, so its first block is the most
    recent and a prompt's tail is dropped before its head, the way a radix tree drops
    leaves first: what remains of a prompt is always a prefix of it.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 block, not {capacity}")
        self.capacity = capacity
        self._blocks: dict[int, OrderedDict[int, None]] = {}

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        """Leading blocks of `hashes` each replica holds; replicas holding none are left out."""
        found = {}
        for replica, blocks in self._blocks.items():
            count = 0
            for block in hashes:
                if block not in blocks:
                    break
                count += 1
            if count:
                found[replica] = count
        return found

    def record(self, replica: int, hashes: Sequence[int]) -> None:
        """Replica `replica` now holds the prompt of `hashes` (it has just served it)."""
        if not hashes:
            return
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for block in reversed(hashes):
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica's cache is empty (it restarted) or gone."""
        self._blocks.pop(replica, None)

    def held(self) -> Mapping[int, int]:
        """Blocks each replica holds."""
        return {replica: len(blocks) for replica, blocks in self._blocks.items()}
