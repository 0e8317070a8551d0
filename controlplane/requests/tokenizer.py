"""Tokenization and incremental detokenization with the Hugging Face ``tokenizers`` library.

Encoding never runs long on the event loop: texts above ``INLINE_CHARS`` are encoded in a small
thread pool shared by every tokenizer (``TOKENIZE_THREADS`` at once, the rest queue), through
``encode_batch``, which releases the GIL while it works (``encode`` holds it: measured, an 8 s
stall of every other thread on a 4 MB text). ``max_token_bytes`` (the longest token's UTF-8
text, from the vocabulary) bounds how much text a prompt of a given length can be.

``encode_within`` never tokenizes much more than what can be served: a text longer (in UTF-8
bytes) than its token limit is first counted piece by piece (``PIECE_CHARS`` characters, cut
at whitespace where there is some), and refused (``TooLong``) as soon as the count, less
``CUT_SLACK`` tokens for each cut, plus the fewest tokens the rest can be (its bytes over
``max_token_bytes``), passes the limit; a text that may fit is then encoded whole (exact).
Time and memory stay proportional to the limit, not to the text."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import pathlib

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from headrace.controlplane.requests.limits import TEXT_MARGIN

# Prompt tokens given to a new decode stream so the first output token decodes in context
# (leading-space handling of SentencePiece-style decoders).
_CONTEXT_TOKENS = 4
INLINE_CHARS = 1024       # shorter texts are encoded at once (well under a millisecond)
TOKENIZE_THREADS = 2      # encodes (and chat renders) running at once; more wait their turn
PIECE_CHARS = 1 << 14     # a long text is counted in pieces of this many characters ...
PIECES_AT_ONCE = 4        # ... this many to an encode_batch call (encoded in parallel)
CUT_SLACK = 16            # tokens a cut between two pieces may add to their count (assumed)
_POOL = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="headrace-tokenize")


async def off_loop(fn, *args, **kwargs):
    """Runs ``fn`` in the tokenization pool; the event loop serves other clients meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))


class TooLong(ValueError):
    """A text has more tokens than its limit: at least ``at_least``."""

    def __init__(self, at_least: int):
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


def _pieces(text: str):
    """``text`` in consecutive pieces of about ``PIECE_CHARS``, each cut after the last space
    or line break of its last quarter when there is one."""
    start, size = 0, len(text)
    while start < size:
        end = min(start + PIECE_CHARS, size)
        if end < size:
            lo = end - PIECE_CHARS // 4
            cut = max(text.rfind(" ", lo, end), text.rfind("\n", lo, end))
            end = cut + 1 if cut > lo else end
        yield text[start:end]
        start = end


class ModelTokenizer:
    def __init__(self, model_dir: str | pathlib.Path):
        path = pathlib.Path(model_dir)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file} not found: headrace needs a tokenizers tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.eos_token_id = self._special_id(cfg.get("eos_token"))

    def _special_id(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.encode(text, add_special_tokens)
        return await off_loop(self.encode, text, add_special_tokens)

    def count_beyond(self, text: str, limit: int) -> int | None:
        """A lower bound on ``text``'s tokens once it is certainly more than ``limit``, found
        without tokenizing much more than ``limit`` tokens' worth of it; None when it may fit.
        The bound is the pieces counted so far, less ``CUT_SLACK`` a cut, plus what the rest
        must hold at least: its bytes over the longest token's (with the normaliser's margin)."""
        left = len(text.encode("utf-8", "surrogatepass"))
        if left + 8 <= limit:   # a token has a byte at least
            return None
        per_token = self.max_token_bytes * TEXT_MARGIN
        pieces, count, cuts = _pieces(text), 0, 0
        while batch := [p for _, p in zip(range(PIECES_AT_ONCE), pieces)]:
            count += sum(len(e.ids) for e in self.tokenizer.encode_batch(batch, add_special_tokens=False))
            left -= sum(len(p.encode("utf-8", "surrogatepass")) for p in batch)
            cuts += len(batch) - (left <= 0)
            bound = count - CUT_SLACK * cuts + int(left / per_token)
            if bound > limit:
                return bound
        return None

    def encode_within(self, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
        """``encode``, or ``TooLong`` when ``text`` has certainly more than ``limit`` tokens."""
        beyond = self.count_beyond(text, limit)
        if beyond is not None:
            raise TooLong(beyond)
        return self.encode(text, add_special_tokens)

    async def encode_within_async(self, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.encode(text, add_special_tokens)
        return await off_loop(self.encode_within, text, limit, add_special_tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text (special tokens included): a prompt of N
        tokens is at most N times this long, but for text the normaliser drops (hence the
        margin of ``headrace.controlplane.requests.limits``)."""
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        texts = self.tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        return max(1, max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1))

    def tokens(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_stream(self, prompt_ids: list[int]) -> "IncrementalDecoder":
        return IncrementalDecoder(self.tokenizer, prompt_ids[-_CONTEXT_TOKENS:])


class IncrementalDecoder:
    """Turns output token ids into text pieces that never split a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int]):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(context_ids), skip_special_tokens=True)
        self._pending: list[int] = []  # ids whose bytes do not form whole characters yet

    def step(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._tokenizer, token_id)
        except Exception:  # ids outside the tokenizer's vocab (padded model vocab) decode to nothing
            return ""
        if piece is None:
            self._pending.append(token_id)
            return ""
        self._pending.clear()
        return piece

    def flush(self) -> str:
        """At the end of a stream: the text of trailing ids that never completed a character
        (as the tokenizer decodes them: replacement characters)."""
        text = self._tokenizer.decode(self._pending, skip_special_tokens=True) if self._pending else ""
        self._pending.clear()
        return text
