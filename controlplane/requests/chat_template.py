"""Chat templates: finds a checkpoint's template (``chat_template.jinja``, or ``chat_template`` in
tokenizer_config.json: a string or a list of named templates) or the ``--chat-template`` file,
and renders conversations with it the way Hugging Face transformers does.

Templates are untrusted code from the Hub: they run in jinja2's ``ImmutableSandboxedEnvironment``
with ``trim_blocks``/``lstrip_blocks``, loop controls, a no-op ``{% generation %}`` block, and the
helpers HF templates call: ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps key order
and does not escape HTML, ``namespace`` and ``dict``. The variables are ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ...) and
any extra keyword arguments (``enable_thinking``, ...). Every failure is a ``ChatTemplateError``.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, the template refused it, bad input)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-token masks in training): renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no reaching into CPython internals)."""

    def __init__(*args, **kwargs):   # noqa: N805 - jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=dict)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from None


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class ChatTemplate:
    """One model's chat template(s) and special tokens."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str]):
        self.templates = templates     # name -> source ("default" when unnamed)
        self.special_tokens = special_tokens

    @classmethod
    def load(cls, model_dir: str | pathlib.Path, override: str | pathlib.Path | None = None
             ) -> "ChatTemplate | None":
        """The template of ``model_dir`` (``override``, a file, wins); None when it has none."""
        path = pathlib.Path(model_dir)
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        specials = {k: t for k in SPECIAL_TOKENS if (t := _token_text(cfg.get(k))) is not None}
        source = cfg.get("chat_template")
        if override is not None:
            source = pathlib.Path(override).read_text()
        elif (path / "chat_template.jinja").exists():
            source = (path / "chat_template.jinja").read_text()
        if not source:
            return None
        if isinstance(source, list):   # [{"name": ..., "template": ...}, ...]
            templates = {t["name"]: t["template"] for t in source}
        else:
            templates = {"default": source}
        for text in templates.values():
            _compile(text)   # a broken template fails at start-up, not on the first request
        return cls(templates, specials)

    def source(self, tools) -> str:
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise ChatTemplateError(f"the model has several chat templates {sorted(self.templates)} "
                                "and none is named 'default'")

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list | None = None,
               documents: list | None = None, **kwargs) -> str:
        """The prompt text for ``messages`` (list of dicts with role, content, ...)."""
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt are exclusive")
        template = _compile(self.source(tools))
        messages = [dict(m) for m in messages]
        final = None
        if continue_final_message:
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError("continue_final_message: the last message has no text content")
            messages[-1]["content"] = final + _CONTINUE_TAG
        variables = {**self.special_tokens, **kwargs}
        try:
            text = template.render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None
        if final is not None:
            tag = text.rfind(_CONTINUE_TAG.strip())
            if tag < 0 or final.strip() not in text:
                raise ChatTemplateError("continue_final_message: the template drops the final message")
            full = text[tag:tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG
            text = text[:tag] if full else text[:tag].rstrip()
        return text
