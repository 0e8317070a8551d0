"""OpenAI's response shapes from the request path's ``GenerateResponse`` streams: SSE chunks
(``chat.completion.chunk`` / ``text_completion``, ``data: [DONE]`` at the end, a usage chunk with
``stream_options.include_usage``) and whole responses, with logprobs in chat style or
completions style. Several prompts of one completions body run concurrently; their choices are
numbered prompt-major (``prompt * n + sample``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable

from headrace.controlplane.http.convert import FINISH
from headrace.controlplane.http.errors import HttpError
from headrace.controlplane.http.tool_calls import ToolCalls
from headrace.controlplane.requests.path import RequestError
from headrace.v1 import inference_pb2 as pb

MIN_LOGPROB = -9999.0   # JSON has no -inf (vLLM clamps the same way)
DONE = b"data: [DONE]\n\n"


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(prompt index, response) from every stream as they come."""
    if len(streams) == 1:
        async for msg in streams[0]:
            yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for msg in stream:
                queue.put_nowait((i, msg, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, msg, exc = await queue.get()
            if exc is not None:
                raise exc
            if msg is None:
                left -= 1
            else:
                yield i, msg
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Formatter:
    """Turns responses into OpenAI dicts for one endpoint (``chat`` or completions)."""

    def __init__(self, chat: bool, model: str, n: int, top_logprobs: int | None,
                 token_text: Callable[[int], str], tools: str | None = None):
        """``tools``: a forced tool choice (the function's name or "required"): chat answers
        are ``tool_calls`` (``headrace.controlplane.http.tool_calls``)."""
        self.chat, self.model, self.n, self.top_n = chat, model, n, top_logprobs
        self.tools = ToolCalls(tools) if tools and chat else None
        self.token_text = token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.offsets: dict[int, int] = {}   # completions' text_offset per choice
        self._prefix: str | None = None      # the fixed start of every text-delta event
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                      "prompt_tokens_details": {"cached_tokens": 0}}

    def index(self, prompt: int, msg: pb.GenerateResponse) -> int:
        return prompt * self.n + msg.index

    def count(self, msg: pb.GenerateResponse) -> None:
        if not msg.finish_reason:
            return
        u = self.usage
        if msg.index == 0:   # the prompt once per prompt, however many samples
            u["prompt_tokens"] += msg.usage.prompt_tokens
            u["prompt_tokens_details"]["cached_tokens"] += msg.usage.cached_prompt_tokens
        u["completion_tokens"] += msg.usage.completion_tokens
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]

    def _entry(self, tid: int, value: float) -> tuple[str, float]:
        return self.token_text(tid), max(value, MIN_LOGPROB)

    def logprobs(self, index: int, msg: pb.GenerateResponse):
        if self.top_n is None or not msg.logprobs:
            return None
        if self.chat:
            content = []
            for lp in msg.logprobs:
                token, value = self._entry(lp.token_id, lp.logprob)
                top = [self._entry(t.token_id, t.logprob) for t in lp.top[:self.top_n]]
                content.append({"token": token, "logprob": value, "bytes": list(token.encode()),
                                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                                 for t, v in top]})
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.offsets.get(index, 0)
        for lp in msg.logprobs:
            token, value = self._entry(lp.token_id, lp.logprob)
            out["tokens"].append(token)
            out["token_logprobs"].append(value)
            out["top_logprobs"].append(dict(self._entry(t.token_id, t.logprob)
                                            for t in lp.top[:self.top_n]) if self.top_n else None)
            out["text_offset"].append(offset)
            offset += len(token)
        self.offsets[index] = offset
        return out

    def chunk(self, prompt: int, msg: pb.GenerateResponse, first: bool) -> dict:
        index = self.index(prompt, msg)
        choice = {"index": index, "logprobs": self.logprobs(index, msg),
                  "finish_reason": FINISH.get(msg.finish_reason)}
        if self.tools is not None:
            choice["delta"] = self.tools.delta(index, msg.text, first, choice["finish_reason"])
            choice["finish_reason"] = self.tools.finish_reason(choice["finish_reason"])
        elif self.chat:
            choice["delta"] = {"role": "assistant", "content": msg.text} if first else \
                ({"content": msg.text} if msg.text or not msg.finish_reason else {})
        else:
            choice["text"] = msg.text
        return {"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                "created": self.created, "model": self.model, "choices": [choice]}


    def sse(self, prompt: int, msg: pb.GenerateResponse, first: bool, include_usage: bool) -> bytes:
        """One SSE event; a plain text delta (most of a stream) is formatted without building
        the dict (a few microseconds per token in the control plane's loop)."""
        if first or msg.finish_reason or self.tools is not None or (self.top_n is not None and msg.logprobs):
            chunk = self.chunk(prompt, msg, first)
            if include_usage:
                chunk["usage"] = None
            return _sse(chunk)
        if self._prefix is None:
            head = {"id": self.id, "object": self.object + (".chunk" if self.chat else ""),
                    "created": self.created, "model": self.model}
            self._prefix = ("data: " + json.dumps(head, ensure_ascii=False)[:-1] + ',"choices":[{"index":')
        text = json.dumps(msg.text, ensure_ascii=False)
        body = f'"delta":{{"content":{text}}}' if self.chat else f'"text":{text}'
        return (f'{self._prefix}{self.index(prompt, msg)},"logprobs":null,"finish_reason":null,{body}}}]'
                f'{USAGE_NULL if include_usage else ""}}}\n\n').encode()


USAGE_NULL = ',"usage":null'


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def sse_chunks(fmt: Formatter, streams: list[AsyncIterator], include_usage: bool,
                     chat: bool) -> AsyncIterator[bytes]:
    """The SSE body. A refusal before the first chunk raises ``HttpError`` (an HTTP status);
    one after it is sent as an error event, then ``[DONE]``."""
    seen: set[int] = set()
    sent = False
    try:
        async for prompt, msg in _merged(streams):
            fmt.count(msg)
            index = fmt.index(prompt, msg)
            event = fmt.sse(prompt, msg, chat and index not in seen, include_usage)
            seen.add(index)
            sent = True
            yield event
    except RequestError as exc:
        error = HttpError.from_request_error(exc, chat)
        if not sent:
            raise error from None
        yield _sse(error.body())
        yield DONE
        return
    if include_usage:
        yield _sse({"id": fmt.id, "object": fmt.object + (".chunk" if chat else ""),
                    "created": fmt.created, "model": fmt.model, "choices": [], "usage": fmt.usage})
    yield DONE


async def whole(fmt: Formatter, streams: list[AsyncIterator], chat: bool) -> dict:
    """The non-streaming response: every choice's text, logprobs and finish reason."""
    choices: dict[int, dict] = {}
    try:
        async for prompt, msg in _merged(streams):
            fmt.count(msg)
            index = fmt.index(prompt, msg)
            c = choices.setdefault(index, {"index": index, "text": [], "logprobs": None,
                                           "finish_reason": None})
            c["text"].append(msg.text)
            lp = fmt.logprobs(index, msg)
            if lp is not None:
                if c["logprobs"] is None:
                    c["logprobs"] = lp
                else:
                    for key, values in lp.items():
                        c["logprobs"][key].extend(values)
            if msg.finish_reason:
                c["finish_reason"] = FINISH.get(msg.finish_reason)
    except RequestError as exc:
        raise HttpError.from_request_error(exc, chat) from None
    out = []
    for index in sorted(choices):
        c = choices[index]
        text = "".join(c.pop("text"))
        if fmt.tools is not None:
            c["message"], c["finish_reason"] = fmt.tools.message(text, c["finish_reason"])
        elif chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        out.append(c)
    return {"id": fmt.id, "object": fmt.object, "created": fmt.created, "model": fmt.model,
            "choices": out, "usage": fmt.usage}
