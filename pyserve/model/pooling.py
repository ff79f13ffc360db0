"""How an embedding model turns a prompt's hidden states into one vector.

The rule is read from the model directory, as sentence-transformers reads
it: modules.json lists the modules after the transformer (a Pooling module
whose config.json names the pooling, then optionally Dense layers, as
EmbeddingGemma has, and Normalize). Without
modules.json: last-token pooling and L2 normalisation, what decoder
embedding models such as Qwen3-Embedding are trained with. A module
pyserve does not apply (Dense, a pooling it does not implement) is refused
when the server starts, never skipped.

Pooling reads the final-norm hidden state of:
- "last": the last prompt token (it may follow a cached prefix);
- "cls": the first token;
- "mean": every token, averaged.
"cls" and "mean" need positions a cached prefix would skip, so their
requests are computed whole (engine/kv/manager.py `can_share`).

Matryoshka (`dimensions`): allowed when config.json says so, as vLLM and
SGLang read it: `matryoshka_dimensions` (the sizes allowed) or
`is_matryoshka: true` (any size up to the hidden size).

An encoder (model/encoders/) without modules.json pools its first
token, the [CLS] token its pooler reads.

A sequence classifier (config.json's architecture ends in
ForSequenceClassification) pools one token through its head (ScoreHead):
the vector is the labels' scores, not normalised. A decoder's (reward
models such as Skywork-Reward-Llama-3.1-8B) pools its last token, as
transformers does for an unpadded prompt, through its `score` layer; an
encoder's (a cross-encoder reranker such as bge-reranker-v2-m3) pools its
first token (or, as ModernBERT's config may say, the mean of all) through
its pooler's or classification head's dense layer and activation (and
LayerNorm, ModernBERT's), then the labels' projection. A cross-encoder reads a (query, document)
pair encoded together as one prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pyserve.model.config import is_sequence_classifier
from pyserve.model.encoders import classifier_head, is_encoder
from pyserve.model.encoders.base import ACTIVATIONS, HeadNames

# sentence-transformers' names (Pooling.pooling_mode) -> ours.
_ST_MODES = {"lasttoken": "last", "cls": "cls", "mean": "mean"}
# Its older config spelled the mode as one boolean per mode.
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class ScoreHead:
    """A sequence classifier's head over its pooled hidden state, in float32:
    a dense layer and its activation first where it has one, then a
    LayerNorm where it has one, then the labels' projection."""

    weight: torch.Tensor  # [labels, hidden]
    bias: torch.Tensor | None = None
    dense: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (weight, bias)
    activation: str = "tanh"
    norm: tuple[torch.Tensor, torch.Tensor | None, float] | None = None  # (weight, bias, eps)

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            vector = ACTIVATIONS[self.activation](F.linear(vector, *self.dense))
        if self.norm is not None:
            weight, bias, eps = self.norm
            vector = F.layer_norm(vector, weight.shape, weight, bias, eps)
        return F.linear(vector, self.weight, self.bias)


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    # Sizes `dimensions` may ask for: None when the model declares no
    # Matryoshka training (only its own size then), () for any size.
    matryoshka_dims: tuple[int, ...] | None = None
    head: ScoreHead | None = field(default=None, compare=False)  # a sequence classifier's; None for an embedding model
    labels: tuple[str, ...] = ()  # its labels' names (config.json id2label)
    cross_encoder: bool = False  # scores a (query, document) pair encoded as one prompt
    # sentence-transformers' Dense modules after the pooling, in order: (weight, bias, activation), float32.
    dense: tuple[tuple[torch.Tensor, torch.Tensor | None, str | None], ...] = field(default=(), compare=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path, hidden_size: int) -> PoolingConfig:
        """The model directory's pooling; ValueError naming the file for
        one pyserve cannot apply."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        encoder = is_encoder(config)
        if is_sequence_classifier(config):
            names = classifier_head(config) if encoder else None
            head = _score_head(model_dir, hidden_size, names)
            count = head.weight.shape[0]
            ids = config.get("id2label") or {}
            labels = tuple(str(ids.get(str(i), f"LABEL_{i}")) for i in range(count))
            return cls(names.pooling if encoder else "last", False, count, None, head, labels, cross_encoder=encoder)
        mode, normalize, dense = "cls" if encoder else "last", True, ()
        modules_file = model_dir / "modules.json"
        if modules_file.is_file():
            mode, normalize, dense = _read_modules(model_dir, json.loads(modules_file.read_text()))
            hidden_size = dense[-1][0].shape[0] if dense else hidden_size
        dims = config.get("matryoshka_dimensions")
        matryoshka = tuple(int(d) for d in dims) if dims else (() if config.get("is_matryoshka") else None)
        return cls(mode, normalize, hidden_size, matryoshka, dense=dense)

    def check_dimensions(self, dimensions: int) -> str | None:
        """None when vectors may be cut to `dimensions`; else why not."""
        if dimensions == self.hidden_size:
            return None
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be between 1 and the model's {self.hidden_size}"
        if self.matryoshka_dims is None:
            return (f"this model's embeddings have {self.hidden_size} dimensions and it declares no Matryoshka "
                    "training (config.json `is_matryoshka` or `matryoshka_dimensions`), so they cannot be cut")
        if self.matryoshka_dims and dimensions not in self.matryoshka_dims:
            return f"this model allows dimensions {list(self.matryoshka_dims)} (config.json matryoshka_dimensions)"
        return None

    def finish(self, total: torch.Tensor, count: int) -> torch.Tensor:
        """The embedding from the float32 sum of the pooled hidden states."""
        vector = total / count if self.mode == "mean" else total
        if self.head is not None:
            return self.head(vector)
        for weight, bias, activation in self.dense:
            vector = F.linear(vector, weight, bias)
            vector = vector if activation is None else ACTIVATIONS[activation](vector)
        return F.normalize(vector, dim=-1) if self.normalize else vector

    def truncate(self, vector: torch.Tensor, dimensions: int) -> torch.Tensor:
        """Matryoshka: the first `dimensions` components, normalised again
        when the model's vectors are normalised."""
        if dimensions == vector.shape[-1]:
            return vector
        vector = vector[..., :dimensions]
        return F.normalize(vector, dim=-1) if self.normalize else vector


def pooled_positions(mode: str, start: int, n: int, prompt_len: int) -> range:
    """The prompt positions among start..start+n whose hidden states `mode` pools."""
    if mode == "mean":
        return range(start, min(start + n, prompt_len))
    wanted = 0 if mode == "cls" else prompt_len - 1
    return range(wanted, wanted + 1) if start <= wanted < start + n else range(0)


def sum_spans(hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Float32 [len(counts), hidden]: the sum of each span of consecutive
    rows, span i being counts[i] rows long. Each span is summed on its own
    rows, in order, so it does not depend on the others."""
    spans = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)).to(hidden.device)
    out = torch.zeros(len(counts), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, spans, hidden.float())


def _score_head(model_dir: Path, hidden_size: int, names: HeadNames | None) -> ScoreHead:
    """The head an encoder classifier's `names` say, or (None) a decoder's
    `score` projection, in float32."""
    from pyserve.model.loader import checkpoint_files

    layers = (None, "score", None) if names is None else (names.dense, names.projection, names.norm)
    wanted = {f"{layer}.{part}" for layer in layers if layer for part in ("weight", "bias")}
    found = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            found.update({key: f.get_tensor(key).float() for key in wanted & set(f.keys())})
    absent = [layer for layer in layers if layer and layer + ".weight" not in found]
    if absent:
        raise ValueError(f"{model_dir}: a sequence classifier's checkpoint without its head's {absent[0]}.weight")
    dense, projection, norm = layers
    weight = found[projection + ".weight"]
    if weight.ndim != 2 or weight.shape[1] != hidden_size:
        raise ValueError(f"{model_dir}: {projection}.weight is {list(weight.shape)}, not [labels, {hidden_size}]")
    bias = found.get(projection + ".bias")
    if names is None:
        return ScoreHead(weight, bias)
    norm_layer = None if norm is None else (found[norm + ".weight"], found.get(norm + ".bias"), names.norm_eps)
    return ScoreHead(weight, bias, (found[dense + ".weight"], found.get(dense + ".bias")), names.activation, norm_layer)


def _read_modules(model_dir: Path, modules: list[dict]) -> tuple[str, bool, tuple]:
    """(mode, normalize, Dense layers) from sentence-transformers' module list."""
    mode, normalize, dense = None, False, []
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling" and mode is None:
            mode = _read_pooling(model_dir / module.get("path", "") / "config.json")
        elif kind == "Dense" and mode is not None and not normalize:
            dense.append(_read_dense(model_dir / module.get("path", "")))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{model_dir / 'modules.json'}: module {module.get('type')!r} is not supported there "
                             "(pyserve applies Transformer, Pooling, Dense and Normalize, in that order)")
    if mode is None:
        raise ValueError(f"{model_dir / 'modules.json'} has no Pooling module")
    return mode, normalize, tuple(dense)


# sentence-transformers' Dense activations pyserve applies (None: identity).
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": "tanh"}


def _read_dense(path: Path) -> tuple[torch.Tensor, torch.Tensor | None, str | None]:
    """A Dense module's (weight, bias, activation), float32."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if name not in _DENSE_ACTIVATIONS:
        raise ValueError(f"{path / 'config.json'}: Dense activation {name!r} is not supported; pyserve applies "
                         f"{list(_DENSE_ACTIVATIONS)}")
    if (path / "model.safetensors").is_file():
        with safe_open(str(path / "model.safetensors"), framework="pt", device="cpu") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    elif (path / "pytorch_model.bin").is_file():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path}: a Dense module without its weights (model.safetensors or pytorch_model.bin)")
    weight = tensors["linear.weight"].float()
    if list(weight.shape) != [config["out_features"], config["in_features"]]:
        raise ValueError(f"{path}: linear.weight is {list(weight.shape)}, not [out_features, in_features]")
    bias = tensors.get("linear.bias")
    return weight, None if bias is None else bias.float(), _DENSE_ACTIVATIONS[name]


def _read_pooling(path: Path) -> str:
    config = json.loads(path.read_text())
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY_KEYS.items() if config.get(key)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"{path}: pooling {modes} is not supported; pyserve pools by one of {list(_ST_MODES)}")
    if not config.get("include_prompt", True):
        raise ValueError(f"{path}: include_prompt false (instruction tokens left out of the pooling) "
                         "is not supported")
    return _ST_MODES[modes[0]]
