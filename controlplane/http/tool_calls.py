"""Chat answers to a forced tool choice (``tool_choice`` naming a function, or ``"required"``),
shaped as OpenAI's ``tool_calls``. The output was constrained to the call's arguments
(``headrace.controlplane.http.structured``): for a named function it is the arguments' JSON itself,
streamed as ``delta.tool_calls[0].function.arguments`` pieces; for ``"required"`` it is a JSON array
of ``{"name", "parameters"}``, parsed into one call each once it is complete (a stream gets them in
its last delta). Finish reasons follow vLLM's: ``stop`` for a named function, ``tool_calls`` for
``required`` (``length`` stays ``length``; an array cut short is returned as plain content)."""

from __future__ import annotations

import json
import uuid


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCalls:
    def __init__(self, mode: str):
        self.mode = mode   # the named function, or "required"
        self.named = mode != "required"
        self._texts: dict[int, str] = {}   # "required", streaming: each choice's text so far

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and not self.named:
            return "tool_calls"
        return reason

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls of a complete answer (None: it is no valid array of calls)."""
        if self.named:
            return [{"id": _call_id(), "type": "function",
                     "function": {"name": self.mode, "arguments": text}}]
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
            return None
        return [{"id": _call_id(), "type": "function",
                 "function": {"name": i["name"],
                              "arguments": json.dumps(i.get("parameters", {}), ensure_ascii=False)}}
                for i in items]

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A whole answer's message and finish reason."""
        calls = self.calls(text) if finish != "length" or self.named else None
        if calls is None:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": None, "tool_calls": calls}, self.finish_reason(finish)

    def delta(self, index: int, text: str, first: bool, finish: str | None) -> dict:
        """One streamed chunk's delta for choice ``index``."""
        delta = {"role": "assistant", "content": None} if first else {}
        if self.named:
            if first:
                delta["tool_calls"] = [{"index": 0, "id": _call_id(), "type": "function",
                                        "function": {"name": self.mode, "arguments": text}}]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            return delta
        whole = self._texts[index] = self._texts.get(index, "") + text
        if finish is not None:
            calls = self.calls(whole) if finish != "length" else None
            if calls is None:
                delta["content"] = whole
            else:
                delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(calls)]
        return delta
