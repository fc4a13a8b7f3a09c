"""The byte-level BPE core shared by the Qwen2 and Whisper tokenizers.

A loader hands over the token bytes -> id table, the merge priority of every mergeable
pair, the special tokens, the split pattern and an optional text normalizer. Encoding is:
cut out special tokens (leftmost, longest first), normalize the text between them, split it
into pieces with the pattern, and merge each piece's bytes, always taking the lowest-ranked
adjacent pair, leftmost on ties. Pieces are cached, so a book costs one BPE run per
distinct word.
"""

import heapq
import re
from functools import lru_cache
from collections.abc import Callable, Iterable, Mapping

# Below this many bytes a quadratic scan beats the heap's bookkeeping.
_HEAP_FROM = 48
_CACHE_MAX = 1 << 18


def merge_pieces(piece: bytes, pair_ranks: Mapping[tuple[bytes, bytes], int]) -> list[bytes]:
    """Merge a piece's bytes by pair rank until no adjacent pair is mergeable."""
    if len(piece) >= _HEAP_FROM:
        return _merge_with_heap(piece, pair_ranks)
    return _merge_by_scan(piece, pair_ranks)


def _merge_by_scan(piece: bytes, pair_ranks: Mapping[tuple[bytes, bytes], int]) -> list[bytes]:
    parts = [piece[i:i + 1] for i in range(len(piece))]
    get = pair_ranks.get
    while len(parts) > 1:
        best_rank, best_at = None, -1
        for i in range(len(parts) - 1):
            rank = get((parts[i], parts[i + 1]))
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_at = rank, i
        if best_rank is None:
            break
        parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def _merge_with_heap(piece: bytes, pair_ranks: Mapping[tuple[bytes, bytes], int]) -> list[bytes]:
    """Same result as the scan, in O(n log n): long pieces (a page of CJK without
    punctuation is one piece) must not go quadratic."""
    n = len(piece)
    parts: list[bytes | None] = [piece[i:i + 1] for i in range(n)]
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    get = pair_ranks.get
    heap = []
    for i in range(n - 1):
        rank = get((parts[i], parts[i + 1]))
        if rank is not None:
            heap.append((rank, i, parts[i], parts[i + 1]))
    heapq.heapify(heap)
    while heap:
        rank, i, left, right = heapq.heappop(heap)
        j = nxt[i]
        # A stale entry: one side has merged since it was pushed.
        if parts[i] != left or j >= n or parts[j] != right:
            continue
        merged = left + right
        parts[i], parts[j] = merged, None
        nxt[i] = nxt[j]
        if nxt[i] < n:
            prv[nxt[i]] = i
            r = get((merged, parts[nxt[i]]))
            if r is not None:
                heapq.heappush(heap, (r, i, merged, parts[nxt[i]]))
        if prv[i] >= 0:
            r = get((parts[prv[i]], merged))
            if r is not None:
                heapq.heappush(heap, (r, prv[i], parts[prv[i]], merged))
    return [p for p in parts if p is not None]


class ByteBPE:
    """Byte-level BPE with special tokens; subclasses only load vocabularies."""

    def __init__(
        self,
        encoder: dict[bytes, int],
        pair_ranks: dict[tuple[bytes, bytes], int],
        special_tokens: dict[str, int],
        pattern: re.Pattern,
        normalize: Callable[[str], str] | None = None,
        whole_piece_lookup: bool = False,
    ) -> None:
        self._encoder = encoder
        self._pair_ranks = pair_ranks
        self._specials = dict(special_tokens)
        self._pattern = pattern
        self._normalize = normalize
        # tiktoken takes a piece that is itself a token as one id; HF BPE always merges.
        self._whole_piece_lookup = whole_piece_lookup
        self._decoder: dict[int, bytes] = {i: b for b, i in encoder.items()}
        self._special_decoder: dict[int, str] = {i: s for s, i in self._specials.items()}
        # Longest first, so `re`'s leftmost-first alternation is leftmost-longest.
        ordered = sorted(self._specials, key=lambda s: (-len(s), s))
        self._special_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._cache: dict[str, list[int]] = {}
        self._size = max([*self._decoder, *self._special_decoder], default=-1) + 1

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it become their single ids."""
        text = _without_lone_surrogates(text)
        ids: list[int] = []
        start = 0
        if self._special_re is not None:
            for match in self._special_re.finditer(text):
                if match.start() > start:
                    self._encode_ordinary(text[start:match.start()], ids)
                ids.append(self._specials[match.group()])
                start = match.end()
        if start < len(text):
            self._encode_ordinary(text[start:], ids)
        return ids

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        if self._normalize is not None:
            text = self._normalize(text)
        cache = self._cache
        for piece in self._pattern.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._encode_piece(piece.encode("utf-8"))
                if len(cache) >= _CACHE_MAX:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)

    def _encode_piece(self, piece: bytes) -> list[int]:
        if self._whole_piece_lookup:
            token = self._encoder.get(piece)
            if token is not None:
                return [token]
        return [self._encoder[p] for p in merge_pieces(piece, self._pair_ranks)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of these ids; bytes that are not valid UTF-8 become U+FFFD."""
        out = bytearray()
        for i in ids:
            i = int(i)
            token = self._decoder.get(i)
            if token is not None:
                out += token
                continue
            special = self._special_decoder.get(i)
            if special is None:
                raise KeyError(f"token id {i} is not in this vocabulary (size {self._size})")
            if not skip_special_tokens:
                out += special.encode("utf-8")
        return out.decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int:
        """Id of a special token, or of a regular token given in the vocabulary's spelling."""
        found = self._specials.get(token)
        if found is None:
            found = self._regular_token_id(token)
        if found is None:
            raise KeyError(f"token {token!r} is not in this vocabulary")
        return found

    def _regular_token_id(self, token: str) -> int | None:
        return self._encoder.get(token.encode("utf-8"))

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token string -> id, in id order."""
        return dict(sorted(self._specials.items(), key=lambda kv: kv[1]))

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self._size

    def __len__(self) -> int:
        return self._size


def _without_lone_surrogates(text: str) -> str:
    """Lone surrogates (possible in a Python str, never in UTF-8) become U+FFFD, as tiktoken does."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to U+0100 onward in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


def token_bytes(token: str, table: dict[str, int]) -> bytes:
    """A vocabulary token spelled in GPT-2's byte alphabet, as bytes."""
    return bytes(table[ch] for ch in token)
