"""ChatTemplate: the checkpoint's template, the ChatML fallback, the helpers HF
templates expect, and the sandbox."""

from __future__ import annotations

import datetime

import pytest

from tests.tiny_tokenizer import smollm2_metadata
from trioserve.errors import ChatTemplateError
from trioserve.models.chat_template import ChatTemplate

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def smollm2_template():
    meta = smollm2_metadata()
    return ChatTemplate(meta["tokenizer.chat_template"], bos_token="<|im_start|>", eos_token="<|im_end|>")


@pytest.mark.slow
def test_smollm2_template_adds_its_default_system_prompt(smollm2_template):
    assert not smollm2_template.is_default
    prompt = smollm2_template.render(CONVERSATION)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.count("<|im_start|>") == 5


@pytest.mark.slow
def test_smollm2_template_keeps_a_given_system_prompt(smollm2_template):
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    prompt = smollm2_template.render(messages, add_generation_prompt=False)
    assert "SmolLM" not in prompt
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert prompt.endswith("And 3+3?<|im_end|>\n")


def test_chatml_fallback():
    template = ChatTemplate(None)
    assert template.is_default
    expected = (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    )
    assert template.render(CONVERSATION, add_generation_prompt=False) == expected
    assert template.render(CONVERSATION) == expected + "<|im_start|>assistant\n"
    # An assistant turn that only called tools has content None.
    assert template.render([{"role": "assistant", "content": None}], add_generation_prompt=False) == (
        "<|im_start|>assistant\n<|im_end|>\n"
    )


def test_content_parts_are_flattened():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    template = ChatTemplate(None)
    assert template.render([{"role": "user", "content": parts}]) == template.render(
        [{"role": "user", "content": "first\nsecond"}]
    )
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    with pytest.raises(ChatTemplateError, match="'image_url'"):
        template.render([{"role": "user", "content": [image]}])


def test_template_variables_and_helpers():
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ flavour }}|"
        "{{ tools | tojson }}|{{ strftime_now('%Y') }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
        "{% generation %}kept{% endgeneration %}"
    )
    tools = [{"type": "function", "function": {"name": "météo", "description": "天気"}}]
    out = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        CONVERSATION, add_generation_prompt=False, tools=tools, flavour="plain"
    )
    year = str(datetime.datetime.now().year)
    tools_json = '[{"type": "function", "function": {"name": "météo", "description": "天気"}}]'
    assert out == f"<s>|</s>|False|plain|{tools_json}|{year}|What is 2+2?|kept"


def test_trim_and_lstrip_blocks():
    source = "  {% for m in messages %}\n[{{ m.role }}]\n  {% endfor %}\n"
    assert ChatTemplate(source).render(CONVERSATION[:2]) == "[user]\n[assistant]\n"


def test_raise_exception_becomes_chat_template_error():
    source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="a system message must come first"):
        ChatTemplate(source).render(CONVERSATION)


def test_syntax_error_is_reported_at_construction():
    with pytest.raises(ChatTemplateError, match="does not compile.*endfor"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


def test_render_time_failures_become_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(CONVERSATION)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__subclasses__() }}",
        "{{ raise_exception.__globals__['__builtins__'] }}",
        "{{ messages.append({'role': 'x'}) }}",  # immutable sandbox: no mutation
        "{{ messages[0].update({'content': 'x'}) }}",
    ],
)
def test_sandbox_blocks_unsafe_access(source):
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate(source).render(CONVERSATION)


def test_unsafe_attribute_renders_as_nothing():
    # A lone unsafe attribute is an undefined value, never the real object.
    assert ChatTemplate("[{{ ''.__class__ }}]").render([]) == "[]"
