"""Chat-template rendering (headrace.controlplane.requests.chat_template) against transformers'
apply_chat_template on templates in the styles of published checkpoints (tests/data/chat_templates),
and the template's discovery, override and failure modes."""

from __future__ import annotations

import json
import pathlib

import pytest

from headrace.controlplane.requests.chat_template import ChatTemplate, ChatTemplateError

DATA = pathlib.Path(__file__).parent / "data" / "chat_templates"
TINY = pathlib.Path(__file__).resolve().parents[1] / "dataplane" / "default_model" / "tiny"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place — «now»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "You are terse. <b>HTML</b> stays & is not escaped."},
        {"role": "user", "content": "Hello, who are you?"},
        {"role": "assistant", "content": "A model."},
        {"role": "user", "content": "  Tell me a joke in 日本語.  "}]
ALTERNATING = CHAT[1:]
TOOL_TURNS = CHAT[:2] + [
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "user", "content": "And tomorrow?"}]
THINKING = CHAT[:2] + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA model."},
                       {"role": "user", "content": "Why?"}]

# (template file, messages, tools, extra kwargs)
CASES = [
    ("llama3.jinja", CHAT, None, {}),
    ("llama3.2-tools.jinja", CHAT, None, {}),
    ("llama3.2-tools.jinja", CHAT, TOOLS, {}),
    ("mistral.jinja", ALTERNATING, None, {}),
    ("qwen2.5.jinja", CHAT, None, {}),
    ("qwen2.5.jinja", ALTERNATING, TOOLS, {}),
    ("qwen2.5.jinja", TOOL_TURNS, TOOLS, {}),
    ("qwen3.jinja", CHAT, None, {}),
    ("qwen3.jinja", THINKING, None, {"enable_thinking": False}),
    ("qwen3.jinja", TOOL_TURNS, TOOLS, {}),
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(TINY / "tokenizer.json"),
                                   bos_token="<s>", eos_token="</s>")


def _ours(source: str) -> ChatTemplate:
    return ChatTemplate({"default": source}, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("name,messages,tools,kwargs", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_transformers(hf_tokenizer, name, messages, tools, kwargs,
                                        add_generation_prompt):
    source = (DATA / name).read_text()
    expected = hf_tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=source, tokenize=False,
        add_generation_prompt=add_generation_prompt, **kwargs)
    got = _ours(source).render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               **kwargs)
    assert got == expected
    if tools:
        assert '"get_weather"' in got and "«now»" in got   # tojson keeps unicode and key order
        assert got.index('"name"') < got.index('"description"')


def test_continue_final_message_matches_transformers(hf_tokenizer):
    source = (DATA / "qwen2.5.jinja").read_text()
    messages = CHAT[:2] + [{"role": "assistant", "content": "Once upon a"}]
    expected = hf_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                continue_final_message=True)
    got = _ours(source).render(messages, add_generation_prompt=False, continue_final_message=True)
    assert got == expected and got.endswith("Once upon a")


def test_raise_exception_becomes_a_chat_template_error():
    template = _ours((DATA / "mistral.jinja").read_text())
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(CHAT)   # a system message first


def test_sandbox_refuses_python_internals():
    template = _ours("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        _ours("{% set ns = namespace(_x=1) %}").render([{"role": "user", "content": "x"}])


def test_generation_block_and_strftime_now_render():
    got = _ours("{% generation %}{{ messages[0].content }}{% endgeneration %}|"
                "{{ strftime_now('%Y') }}").render([{"role": "user", "content": "hi"}])
    import datetime

    assert got == f"hi|{datetime.date.today().year}"


def test_discovery_named_lists_jinja_file_and_override(tmp_path):
    cfg = {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
           "chat_template": [{"name": "default", "template": "D{{ bos_token }}"},
                             {"name": "tool_use", "template": "T{{ tools | length }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "x"}]
    template = ChatTemplate.load(tmp_path)
    assert template.render(msgs) == "D<s>"
    assert template.render(msgs, tools=TOOLS) == "T1"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert ChatTemplate.load(tmp_path).render(msgs) == "J</s>"
    override = tmp_path / "mine.jinja"
    override.write_text("O{{ messages[0].content }}")
    assert ChatTemplate.load(tmp_path, override).render(msgs) == "Ox"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.load(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.load(tmp_path)


def test_embedded_model_has_a_template():
    text = ChatTemplate.load(TINY).render([{"role": "user", "content": "Good morning."}])
    assert text.startswith("<s>") and "Good morning." in text
