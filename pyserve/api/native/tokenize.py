"""POST /tokenize, POST /detokenize and GET /tokenizer_info, in vLLM's
shapes (which SGLang mirrors; both also serve them under /v1).

Messages are rendered by the chat route's own `prepare`, so their ids are
exactly the prompt a chat request would run. Tokenizing and decoding run
in the Rust tokenizer on a worker thread, with the GIL released, so a long
text does not hold up the event loop or the forward thread.
"""

from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec

from pyserve.api.openai import chat
from pyserve.http.errors import bad_request
from pyserve.api.protocol.openai import ChatMessage
from pyserve.api.generation.serving import ServingContext
from pyserve.http.strict import convert_strict


# Unknown fields are refused (api/strict.py): a setting such as vLLM's
# truncate_prompt_tokens would change the ids, so ignoring it would answer
# another question.
class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: Any = None  # a text, or a list of texts (SGLang)
    messages: list[ChatMessage] | None = None
    # Default: True for a prompt, False for messages (their template writes the special tokens).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's per-request template: refused


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: Any  # token ids, or a list of token id lists (SGLang)


async def tokenize(ctx: ServingContext, body: dict) -> dict:
    req = convert_strict(body, TokenizeRequest, "/tokenize")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either prompt or messages", "messages" if req.prompt is not None else "prompt")
    tokenizer = ctx.engine.tokenizer
    if req.messages is not None:
        ids = await asyncio.to_thread(_chat_prompt, ctx, req)
    elif isinstance(req.prompt, str):
        add = req.add_special_tokens is not False
        ids = await asyncio.to_thread(tokenizer.encode, req.prompt, add)
    elif isinstance(req.prompt, list) and req.prompt and all(isinstance(p, str) for p in req.prompt):
        add = req.add_special_tokens is not False
        lists = await asyncio.to_thread(tokenizer.encode_batch, req.prompt, add)
        return {"count": [len(ids) for ids in lists], "max_model_len": ctx.engine.context_len, "tokens": lists,
                "token_strs": [_token_strs(ctx, ids) for ids in lists] if req.return_token_strs else None}
    else:
        raise bad_request("prompt must be a string or a non-empty list of strings", "prompt")
    return {"count": len(ids), "max_model_len": ctx.engine.context_len, "tokens": ids,
            "token_strs": _token_strs(ctx, ids) if req.return_token_strs else None}


def _chat_prompt(ctx: ServingContext, req: TokenizeRequest) -> list[int]:
    """The ids a chat request with these messages would run."""
    if req.add_special_tokens:
        raise bad_request("add_special_tokens cannot be true with messages: the chat template writes the "
                          "special tokens", "add_special_tokens")
    if req.chat_template is not None:
        raise bad_request("a per-request chat_template is not supported: the server's template renders messages",
                          "chat_template")
    return chat.conversation_ids(ctx, req.messages, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message, tools=req.tools,
                                 chat_template_kwargs=req.chat_template_kwargs)


def _token_strs(ctx: ServingContext, ids: list[int]) -> list[str]:
    tokenizer = ctx.engine.tokenizer
    return [tokenizer.id_to_token(i) or "" for i in ids]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


async def detokenize(ctx: ServingContext, body: dict) -> dict:
    req = convert_strict(body, DetokenizeRequest, "/detokenize")
    tokens = req.tokens
    single = _is_ids(tokens)
    if single:
        lists = [tokens]
    elif isinstance(tokens, list) and tokens and all(_is_ids(t) for t in tokens):
        lists = tokens
    else:
        raise bad_request("tokens must be a list of token ids or a list of such lists", "tokens")
    tokenizer = ctx.engine.tokenizer
    vocab = tokenizer.vocab_size
    bad = next((i for ids in lists for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab})", "tokens", "invalid_value")
    try:
        texts = await asyncio.to_thread(lambda: [tokenizer.decode(ids, skip_special_tokens=False) for ids in lists])
    except ValueError as e:  # an id the tokenizer has no token for
        raise bad_request(str(e), "tokens", "invalid_value") from None
    return {"prompt": texts[0] if single else texts}


def tokenizer_info(ctx: ServingContext) -> dict:
    """The tokenizer's configuration (tokenizer_config.json, as vLLM
    returns it), with the chat template this server renders and the
    vocabulary and context sizes it uses."""
    info = dict(_tokenizer_config(ctx.engine.tokenizer_dir))
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    template = ctx.chat_template
    info["chat_template"] = None if template is None else template.sources.get("default") or next(
        iter(template.sources.values()))
    info["vocab_size"] = ctx.engine.tokenizer.vocab_size
    info["max_model_len"] = ctx.engine.context_len
    return info


@lru_cache(maxsize=4)
def _tokenizer_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
