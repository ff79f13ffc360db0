"""Chat templates render exactly as transformers' apply_chat_template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pyserve.chat_template import ChatTemplate, ChatTemplateError, builtin_templates

CONVERSATIONS = [
    [{"role": "user", "content": "List 3 countries and their capitals."}],
    [{"role": "system", "content": "You are a helpful AI assistant"},
     {"role": "user", "content": "你好 🎉"}],
    [{"role": "system", "content": "You are a knowledgeable historian who provides concise responses."},
     {"role": "user", "content": "Tell me about ancient Rome"},
     {"role": "assistant", "content": "Ancient Rome was a civilization centered in Italy."},
     {"role": "user", "content": "What were their major achievements?"}],
    [{"role": "user", "content": "  spaces around  \n"},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": ""}],
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo à Paris",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22°C"},
]

# A template in the style of Qwen3's: kwargs, tojson, raise_exception, tools.
QWEN_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('bad role ' + m.role) }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# A template in the style of Llama 3.1's: a dated system header, tools as
# indented JSON, tool calls and results, namespace and loop controls.
LLAMA31_STYLE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.system = m.content %}{%- break %}{%- endif %}{%- endfor %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}
{%- if tools is not none %}
    {{- 'You may call these functions:\\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- ns.system + '<|eot_id|>' }}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- if m.tool_calls is defined %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for call in m.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif m.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# transformers' {% generation %} tag, and a check of which special tokens are defined.
GENERATION_TAG = (
    "{% if sep_token is defined %}SEP{% endif %}{{ eos_token }}|"
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
    "{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def model_dir_with(tmp_path_factory, default_model_dir, template) -> Path:
    d = tmp_path_factory.mktemp("template")
    shutil.copy(default_model_dir / "tokenizer.json", d)
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def qwen_style_dir(tmp_path_factory, default_model_dir):
    return model_dir_with(tmp_path_factory, default_model_dir, QWEN_STYLE)


def hf_render(model_dir, messages, add_generation_prompt=True, **kwargs) -> str:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_default_model_template_matches_transformers(default_model_dir, i):
    ours = ChatTemplate.for_model(default_model_dir).render(CONVERSATIONS[i])
    assert ours == hf_render(default_model_dir, CONVERSATIONS[i])


@pytest.mark.parametrize("name", ["chatml", "llama3"])
@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_builtin_templates_match_transformers(tmp_path_factory, default_model_dir, name, i):
    source = (ChatTemplate.for_model(default_model_dir, name)).sources["default"]
    model_dir = model_dir_with(tmp_path_factory, default_model_dir, source)
    assert ChatTemplate.for_model(model_dir).render(CONVERSATIONS[i]) == hf_render(model_dir, CONVERSATIONS[i])


def test_llama31_style_tools_and_tool_calls_match_transformers(tmp_path_factory, default_model_dir):
    model_dir = model_dir_with(tmp_path_factory, default_model_dir, LLAMA31_STYLE)
    template = ChatTemplate.for_model(model_dir)
    for messages, tools in [(CONVERSATIONS[2], None), (TOOL_CONVERSATION, TOOLS)]:
        ours = template.render(messages, tools=tools)
        assert ours == hf_render(model_dir, messages, tools=tools)
    assert '"city": "Paris"' in ours and "Météo" in ours and "    " in ours


def test_generation_tag_and_special_tokens_match_transformers(tmp_path_factory, default_model_dir):
    model_dir = model_dir_with(tmp_path_factory, default_model_dir, GENERATION_TAG)
    ours = ChatTemplate.for_model(model_dir).render(CONVERSATIONS[2])
    assert ours == hf_render(model_dir, CONVERSATIONS[2])
    assert ours.startswith("<|im_end|>|")  # eos_token set, sep_token undefined


def test_kwargs_and_tools_match_transformers(qwen_style_dir):
    ours = ChatTemplate.for_model(qwen_style_dir).render(
        CONVERSATIONS[0], tools=TOOLS, template_kwargs={"enable_thinking": False})
    assert ours == hf_render(qwen_style_dir, CONVERSATIONS[0], tools=TOOLS, enable_thinking=False)
    assert "<think>" in ours and "météo" in ours.lower()


@pytest.mark.parametrize("name", ["default-model", "chatml", "llama3"])
@pytest.mark.parametrize("final", ["Hi, I am", "Hi, I am  ", "Sure:\n"])
def test_continue_final_message_matches_transformers(tmp_path_factory, default_model_dir, name, final):
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": final}]
    model_dir = default_model_dir
    if name != "default-model":
        source = ChatTemplate.for_model(default_model_dir, name).sources["default"]
        model_dir = model_dir_with(tmp_path_factory, default_model_dir, source)
    ours = ChatTemplate.for_model(model_dir).render(messages, continue_final_message=True)
    assert ours == hf_render(model_dir, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours.rstrip().endswith(final.strip())


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path_factory, default_model_dir):
    named = [{"name": "default", "template": "D{{ messages | length }}"},
             {"name": "tool_use", "template": "T{{ tools | length }}"}]
    model_dir = model_dir_with(tmp_path_factory, default_model_dir, named)
    template = ChatTemplate.for_model(model_dir)
    assert template.render(CONVERSATIONS[0]) == "D1" == hf_render(model_dir, CONVERSATIONS[0])
    assert template.render(CONVERSATIONS[0], tools=TOOLS) == "T1" == hf_render(model_dir, CONVERSATIONS[0],
                                                                             tools=TOOLS)


def test_raise_exception_becomes_a_template_error(qwen_style_dir):
    with pytest.raises(ChatTemplateError, match="bad role"):
        ChatTemplate.for_model(qwen_style_dir).render([{"role": "tool", "content": "x"}])


def test_a_failing_template_is_a_template_error(qwen_style_dir):
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        ChatTemplate.for_model(qwen_style_dir).render([{"role": "user"}])  # content missing: None + str


@pytest.mark.parametrize("name", builtin_templates())
def test_builtin_templates_render(default_model_dir, name):
    text = ChatTemplate.for_model(default_model_dir, name).render(CONVERSATIONS[2])
    assert "Ancient Rome was a civilization" in text
    assert set(builtin_templates()) >= {"chatml", "llama3"}


def test_template_file_override(tmp_path, default_model_dir):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert ChatTemplate.for_model(default_model_dir, str(path)).render(CONVERSATIONS[0]) == \
        "[user]List 3 countries and their capitals."


def test_unknown_override_is_a_clear_error(default_model_dir):
    with pytest.raises(ValueError, match="neither a file nor one of"):
        ChatTemplate.for_model(default_model_dir, "no-such-template")
