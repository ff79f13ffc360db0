"""Prompts given as embeddings instead of token ids, on a server started
with --enable-prompt-embeds: vLLM's `prompt_embeds` (/v1/completions: the
base64 of a tensor torch.save wrote, read back with torch.load's
weights_only, which rebuilds tensors and nothing else) and SGLang's
`input_embeds` (/generate: nested lists of floats). Each becomes a
[tokens, hidden] tensor the engine checks (admission.py) and the model
reads in place of looking up the tokens; the request's token ids are
placeholders of its length."""

from __future__ import annotations

import base64
import io

import torch

from pyserve.http.errors import bad_request

PLACEHOLDER_ID = 0  # the id each embedded position stands under (any in the vocabulary does)


def embeds_from_base64(value: str | list[str], param: str) -> list[torch.Tensor]:
    """vLLM's prompt_embeds: one base64 tensor or a list of them."""
    items = [value] if isinstance(value, str) else value
    if not items:
        raise bad_request(f"{param} is an empty list", param)
    tensors = []
    for item in items:
        try:
            loaded = torch.load(io.BytesIO(base64.b64decode(item, validate=True)), weights_only=True,
                                map_location="cpu")
        except Exception as e:  # whatever a malformed file raises, from base64, zip or the restricted unpickler
            raise bad_request(f"{param} is the base64 of a tensor torch.save wrote: {e}", param) from None
        if not isinstance(loaded, torch.Tensor):
            raise bad_request(f"{param} holds a {type(loaded).__name__}, not a tensor", param)
        tensors.append(_two_dimensional(loaded.to_dense() if loaded.is_sparse else loaded, param))
    return tensors


def embeds_from_lists(value: list, param: str) -> tuple[list[torch.Tensor], bool]:
    """SGLang's input_embeds: [tokens][hidden] floats for one prompt, or a
    list of those; (the tensors, whether it was one prompt)."""
    batch = bool(value) and isinstance(value[0], list) and bool(value[0]) and isinstance(value[0][0], list)
    try:
        tensors = [torch.tensor(prompt, dtype=torch.float32) for prompt in (value if batch else [value])]
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param} is a list of rows of floats (or a list of such lists, one per prompt): {e}",
                          param) from None
    return [_two_dimensional(t, param) for t in tensors], not batch


def placeholder_ids(embeds: torch.Tensor) -> list[int]:
    return [PLACEHOLDER_ID] * embeds.shape[0]


def _two_dimensional(tensor: torch.Tensor, param: str) -> torch.Tensor:
    """[tokens, hidden]; a batch of one ([1, tokens, hidden]) as vLLM takes it."""
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] == 0:
        raise bad_request(f"{param} must be [tokens, hidden size] with at least one token, not a tensor of shape "
                          f"{tuple(tensor.shape)}", param)
    return tensor
