"""Per-request output text: incremental detokenization and stop strings.

Stop strings are matched across step boundaries; while streaming, the last
``len(longest stop) - 1`` characters are held back because they may begin a stop string.
The matched stop string and everything after it never reach the client.
"""

from __future__ import annotations

from headrace.controlplane.requests.tokenizer import IncrementalDecoder


class OutputText:
    def __init__(self, decoder: IncrementalDecoder, stop: list[str]):
        self._decoder = decoder
        self._stop = stop
        self.has_stop = bool(stop)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self._stopped = False

    def add(self, token_id: int) -> bool:
        """Appends a token's text; returns True when a stop string matched (text is cut there)."""
        piece = self._decoder.step(token_id)
        if not piece:
            return False
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        if not self._stop:
            return False
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self._stopped = True
            return True
        return False

    def delta(self, final: bool) -> str:
        """Text not sent yet; while streaming, holds back a possible stop-string prefix."""
        if final and not self._stopped:
            self.text += self._decoder.flush()
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        piece, self._sent = self.text[self._sent:end], end
        return piece
