"""A conversation (``ChatMessages`` of a GenerateRequest or an HTTP chat body) checked and
rendered to the prompt text with the model's chat template: the cheap checks first (a
template exists, 1 to ``MAX_MESSAGES`` messages, their size within what a prompt can be), then
the messages as the template expects them (``extra_json`` fields merged, tools, documents and
template keyword arguments parsed). Every problem is a ``ValidationError`` naming its field;
the request path tokenizes the text."""

from __future__ import annotations

import json

from headrace.controlplane.requests.chat_template import ChatTemplate, ChatTemplateError
from headrace.controlplane.requests.errors import ValidationError
from headrace.v1 import inference_pb2 as pb

MAX_MESSAGES = 4096
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")


def _json(field: str, text: str, kind: type):
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValidationError(f"messages.{field} is not valid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise ValidationError(f"messages.{field} must be a JSON {kind.__name__}")
    return value


def check(chat: pb.ChatMessages, template: ChatTemplate | None, max_text_bytes: int) -> int:
    """The cheap checks of a conversation; returns its size in characters."""
    if template is None:
        raise ValidationError("messages: the model has no chat template (no chat_template in "
                              "tokenizer_config.json, no chat_template.jinja); start the server "
                              "with --chat-template FILE or send a prompt")
    if not chat.messages:
        raise ValidationError("messages must not be empty")
    if len(chat.messages) > MAX_MESSAGES:
        raise ValidationError(f"messages: at most {MAX_MESSAGES} messages")
    size = sum(len(m.content) + len(m.extra_json) + len(m.role) + len(m.name)
               for m in chat.messages) + len(chat.tools_json) \
        + len(chat.documents_json) + len(chat.template_kwargs_json)
    if size > max_text_bytes:
        raise ValidationError(f"messages are longer than any prompt the model can take: at "
                              f"most {max_text_bytes} characters in all")
    return size


def render(chat: pb.ChatMessages, template: ChatTemplate | None, max_text_bytes: int) -> str:
    """The prompt text of a conversation (``check`` first)."""
    check(chat, template, max_text_bytes)
    messages = []
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise ValidationError(f"messages[{i}].role must not be empty")
        message = _json(f"messages[{i}].extra_json", m.extra_json, dict) or {}
        message.update(role=m.role, content=m.content)
        if m.HasField("name"):
            message["name"] = m.name
        messages.append(message)
    kwargs = _json("template_kwargs_json", chat.template_kwargs_json, dict) or {}
    for reserved in _RESERVED:
        kwargs.pop(reserved, None)
    add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else \
        not chat.continue_final_message
    try:
        return template.render(messages, add_generation_prompt=add_gen,
                               continue_final_message=chat.continue_final_message,
                               tools=_json("tools_json", chat.tools_json, list),
                               documents=_json("documents_json", chat.documents_json, list), **kwargs)
    except ChatTemplateError as exc:
        raise ValidationError(f"messages: {exc}") from None
