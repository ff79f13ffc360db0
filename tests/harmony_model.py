"""A tokenizer with gpt-oss's Harmony special tokens and a chat template
that renders as gpt-oss's does (tests/fixtures/gpt_oss_chat_template.jinja),
for tests of the Harmony parsers:

    from tests.harmony_model import build_harmony_tokenizer
    tokenizer_dir = build_harmony_tokenizer(tmp_path, default_model_dir)

The vocabulary is the default model's, with gpt-oss's special tokens added
as special tokens (decoding skips them unless told not to), and its
end-of-sequence tokens: `<|return|>` ends an answer, `<|call|>` a call.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = Path(__file__).parent / "fixtures" / "gpt_oss_chat_template.jinja"
# gpt-oss's special tokens, the Harmony markers among them.
SPECIAL = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>")
EOS = ("<|return|>", "<|call|>", "<|endoftext|>")  # generation_config's eos_token_id, in gpt-oss's order


def build_harmony_tokenizer(out_dir: str | Path, base_dir: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json
    to `out_dir`: `base_dir`'s vocabulary plus gpt-oss's special tokens."""
    from tokenizers import AddedToken, Tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(Path(base_dir) / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
              "pad_token": "<|endoftext|>", "model_max_length": 131072, "chat_template": TEMPLATE.read_text()}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tokenizer.token_to_id(t) for t in EOS]
    generation = {"bos_token_id": tokenizer.token_to_id("<|startoftext|>"), "eos_token_id": ids,
                  "pad_token_id": tokenizer.token_to_id("<|endoftext|>")}
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out
