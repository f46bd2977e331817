"""Which replica has most likely cached a prompt's prefix: the bookkeeping of the Ray Serve
router (server/ray_serve.py), kept free of Ray so that it is tested on its own.

A router in front of several engines cannot see their KV caches, and it has no tokenizer; it sees
the request's text. So it remembers, for each prefix of the texts it routed, the replica it sent
them to, as chained hashes of fixed-size character chunks (the engine's prefix cache hashes token
blocks the same way: a chunk's hash covers everything before it). A new request goes to the
replica holding its longest remembered prefix; one that matches nothing goes to the replica the
index holds the fewest chunks for, which spreads new prefixes over the replicas evenly.

Characters stand in for tokens: two prompts that share their first 64 characters share about
their first 16 tokens, one KV block at the default block size.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

DEFAULT_CHUNK_CHARS = 64
DEFAULT_MAX_CHUNKS = 100_000  # remembered chunk hashes, about 10 MB; the least recently used go first
# Characters of a text that count: beyond ~4k tokens a longer match gains little over a shorter one.
_MAX_CHARS = 16_384


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """The chained hashes of `text`'s whole chunks of `chunk_chars` characters (a last partial
    chunk counts only when it is the whole text): hash i covers characters [0, (i+1)*chunk_chars)."""
    text = text[:_MAX_CHARS]
    ends = list(range(chunk_chars, len(text) + 1, chunk_chars)) or ([len(text)] if text else [])
    out, h, start = [], b"", 0
    for end in ends:
        # sha256, not hash(): the same text must hash alike in every process and run.
        h = hashlib.sha256(h + text[start:end].encode("utf-8", "surrogatepass")).digest()
        out.append(h)
        start = end
    return out


@dataclass(frozen=True, slots=True)
class Match:
    replica: str | None  # None: no remembered prefix on any allowed replica
    chunks: int  # chunks of the text matched there


class PrefixIndex:
    """chunk hash -> the replica that last served a text with that prefix, least recently used
    dropped first beyond `max_chunks`."""

    def __init__(self, chunk_chars: int = DEFAULT_CHUNK_CHARS, max_chunks: int = DEFAULT_MAX_CHUNKS):
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars={chunk_chars} must be >= 1")
        if max_chunks < 1:
            raise ValueError(f"max_chunks={max_chunks} must be >= 1")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._held = Counter()  # replica -> chunks the index holds for it

    def match(self, text: str, replicas: Collection[str]) -> Match:
        """The replica among `replicas` holding the longest remembered prefix of `text`."""
        hashes = chunk_hashes(text, self.chunk_chars)
        for n in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[n - 1])
            if owner is not None and owner in replicas:
                return Match(owner, n)
        return Match(None, 0)

    def least_held(self, replicas: Collection[str]) -> str:
        """The replica the index holds the fewest chunks for (ties: the first in order)."""
        return min(sorted(replicas), key=lambda r: self._held[r])

    def record(self, text: str, replica: str) -> None:
        """`replica` now serves `text`: every prefix of it is found there."""
        for h in chunk_hashes(text, self.chunk_chars):
            old = self._owner.pop(h, None)
            if old is not None:
                self._held[old] -= 1
            self._owner[h] = replica
            self._held[replica] += 1
        while len(self._owner) > self.max_chunks:
            _, old = self._owner.popitem(last=False)
            self._held[old] -= 1

    def forget(self, replica: str) -> None:
        """A replica is gone: its prefixes are nowhere any more."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
        self._held.pop(replica, None)

    def held(self, replica: str) -> int:
        return self._held[replica]
