"""OpenAI-compatible request bodies -> ``GenerateRequest`` (one per prompt); the finish reasons
the other way (the errors' mapping is ``headrace.controlplane.http.errors``)."""

from __future__ import annotations

import json

from headrace.controlplane.http import structured
from headrace.controlplane.http.errors import HttpError
from headrace.controlplane.http.protocol import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from headrace.v1 import inference_pb2 as pb

FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
          pb.FINISH_REASON_STOP_STRING: "stop", pb.FINISH_REASON_ABORTED: "abort"}


def _unsupported(param: str, what: str = "") -> HttpError:
    return HttpError(400, f"{param} is not supported{what}", param)


def _common(body, max_tokens: int | None, logprobs: int, chat: bool = False) -> pb.GenerateRequest:
    if body.stream_options is not None and not body.stream:
        raise HttpError(400, "stream_options is only allowed when stream is true", "stream_options")
    req = pb.GenerateRequest(request_id=body.request_id or "", n=body.n, min_tokens=body.min_tokens,
                             model=body.model or "",
                             ignore_eos=body.ignore_eos, priority=body.priority, logprobs=logprobs,
                             stop=[body.stop] if isinstance(body.stop, str) else (body.stop or []),
                             stop_token_ids=body.stop_token_ids or [])
    if max_tokens is not None:
        req.max_tokens = max_tokens
    s = req.sampling
    for field in ("temperature", "top_p", "repetition_penalty", "seed"):
        if (value := getattr(body, field)) is not None:
            setattr(s, field, value)
    s.top_k = 0 if body.top_k in (None, -1) else body.top_k   # vLLM: -1 disables
    s.min_p = body.min_p or 0.0
    s.presence_penalty, s.frequency_penalty = body.presence_penalty, body.frequency_penalty
    for token, bias in (body.logit_bias or {}).items():   # OpenAI's keys: token ids as strings
        try:
            s.logit_bias[int(token)] = bias
        except (ValueError, OverflowError):   # (ids past uint32 overflow the map's key)
            raise HttpError(400, f"logit_bias: {token!r} is not a token id", "logit_bias") from None
    constraint, _ = structured.constraint(body, chat)
    if constraint is not None:
        req.structured.CopyFrom(constraint)
    return req


def completion_requests(body: CompletionRequest) -> list[pb.GenerateRequest]:
    if body.echo:
        raise _unsupported("echo")
    if body.suffix:
        raise _unsupported("suffix")
    if body.best_of not in (None, body.n):
        raise _unsupported("best_of", " (other than equal to n)")
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise HttpError(400, "prompt must not be empty", "prompt")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens   # OpenAI's default here
    out = []
    for i, p in enumerate(prompts):
        req = _common(body, max_tokens, 0 if body.logprobs is None else max(body.logprobs, 1))
        if len(prompts) > 1 and req.request_id:
            req.request_id = f"{req.request_id}-{i}"
        if isinstance(p, str):
            req.prompt = p
        else:
            bad = next((t for t in p if not 0 <= t < 1 << 32), None)
            if bad is not None:
                raise HttpError(400, f"prompt: token ids must be >= 0 and < 2**32, got {bad}", "prompt")
            req.prompt_token_ids.ids.extend(p)
        out.append(req)
    return out


def _message(m: ChatMessageIn, i: int) -> pb.ChatMessage:
    if m.content is None:
        content = ""
    elif isinstance(m.content, str):
        content = m.content
    else:
        if any(p.type != "text" or p.text is None for p in m.content):
            raise HttpError(400, f"messages[{i}].content: only text parts are supported", "messages")
        content = "\n".join(p.text for p in m.content)
    extra = dict(m.model_extra or {})
    for call in extra.get("tool_calls") or ():   # templates expect arguments as a dict (as vLLM)
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
    msg = pb.ChatMessage(role=m.role, content=content, extra_json=json.dumps(extra) if extra else "")
    if m.name is not None:
        msg.name = m.name
    return msg


def chat_messages(messages: list[ChatMessageIn], *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, tools=None, documents=None,
                  kwargs=None) -> pb.ChatMessages:
    chat = pb.ChatMessages(messages=[_message(m, i) for i, m in enumerate(messages)],
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message)
    if tools:
        chat.tools_json = json.dumps(tools)
    if documents:
        chat.documents_json = json.dumps(documents)
    if kwargs:
        chat.template_kwargs_json = json.dumps(kwargs)
    return chat


def chat_request(body: ChatCompletionRequest) -> pb.GenerateRequest:
    if body.top_logprobs and not body.logprobs:
        raise HttpError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # logprobs without top_logprobs still return the sampled token's logprob: ask for one
    logprobs = max(body.top_logprobs or 0, 1) if body.logprobs else 0
    req = _common(body, max_tokens, logprobs, chat=True)
    req.messages.CopyFrom(chat_messages(
        body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, tools=body.tools,
        documents=body.documents, kwargs=body.chat_template_kwargs))
    return req
