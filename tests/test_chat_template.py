"""Chat templates render exactly as transformers' apply_chat_template."""

from __future__ import annotations

import json
import shutil

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


@pytest.fixture(scope="module")
def qwen_style_dir(tmp_path_factory, default_model_dir):
    d = tmp_path_factory.mktemp("qwen-style")
    shutil.copy(default_model_dir / "tokenizer.json", d)
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_STYLE
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def hf_render(model_dir, messages, **kwargs) -> str:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_default_model_template_matches_transformers(default_model_dir, i):
    ours = ChatTemplate.for_model(default_model_dir).render(CONVERSATIONS[i])
    assert ours == hf_render(default_model_dir, CONVERSATIONS[i])


def test_kwargs_and_tools_match_transformers(qwen_style_dir):
    tools = [{"type": "function", "function": {"name": "weather", "description": "météo à Paris"}}]
    ours = ChatTemplate.for_model(qwen_style_dir).render(
        CONVERSATIONS[0], tools=tools, template_kwargs={"enable_thinking": False})
    assert ours == hf_render(qwen_style_dir, CONVERSATIONS[0], tools=tools, enable_thinking=False)
    assert "<think>" in ours and "météo" in ours


def test_raise_exception_becomes_a_template_error(qwen_style_dir):
    with pytest.raises(ChatTemplateError, match="bad role"):
        ChatTemplate.for_model(qwen_style_dir).render([{"role": "tool", "content": "x"}])


def test_continue_final_message_ends_inside_the_last_turn(default_model_dir):
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]
    text = ChatTemplate.for_model(default_model_dir).render(messages, continue_final_message=True)
    assert text.endswith("Hi, I am")


@pytest.mark.parametrize("name", builtin_templates())
def test_builtin_templates_render(default_model_dir, name):
    text = ChatTemplate.for_model(default_model_dir, name).render(CONVERSATIONS[2])
    assert "Ancient Rome was a civilization" in text
    assert set(builtin_templates()) >= {"chatml", "llama3"}


def test_unknown_override_is_a_clear_error(default_model_dir):
    with pytest.raises(ValueError, match="neither a file nor one of"):
        ChatTemplate.for_model(default_model_dir, "no-such-template")
