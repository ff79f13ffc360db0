"""Tiny encoder checkpoints (BERT, XLM-RoBERTa, ModernBERT) built with
transformers' own classes and a tokenizer built with the `tokenizers`
library, laid out as the hub ships them: a sentence-embedding model
(all-MiniLM, bge-m3, gte-modernbert) with sentence-transformers'
modules.json, or a cross-encoder reranker (ms-marco-MiniLM, bge-reranker,
gte-reranker-modernbert) as a ForSequenceClassification."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ("the a is of and to in what which where who capital city country paris france berlin germany tokyo japan "
         "river rome italy big small cat dog sat on mat answer question fish bird blue sky red sun").split()
FAMILIES = ("bert", "xlm-roberta", "modernbert")


def _tokenizer(family: str):
    """The family's tokenizer: WordPiece with BERT's [CLS] a [SEP] b [SEP]
    pair template and segment ids, or RoBERTa's <s> a </s></s> b </s>."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if family in ("bert", "modernbert"):
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        vocab = {token: i for i, token in enumerate(specials + list(WORDS))}
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
        # BERT's segments are a model input; ModernBERT has none.
        inputs = ["input_ids", "token_type_ids", "attention_mask"] if family == "bert" else ["input_ids", "attention_mask"]
        names = dict(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
                     model_input_names=inputs)
    else:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        vocab = {token: i for i, token in enumerate(specials + list(WORDS))}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        names = dict(bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>", pad_token="<pad>",
                     unk_token="<unk>", mask_token="<mask>")
    for token in specials:
        tok.add_special_tokens([token])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names), len(vocab)


def build_tiny_encoder(out_dir: str | Path, family: str, num_labels: int | None = None, pooling: str = "cls",
                       seed: int = 0, **shape) -> Path:
    """A tiny `family` (one of FAMILIES) checkpoint in `out_dir`: a
    sentence-embedding model pooling by `pooling` ("cls" or "mean") and
    normalising, or with `num_labels` a cross-encoder classifier (a
    ModernBERT one pooling by `pooling`). Weights drawn wider than
    transformers' default initialisation, so texts differ. ModernBERT's
    local layers see 4 tokens either side, fewer than a long text has.
    `shape`: config fields instead of the tiny ones (hidden_size, ...)."""
    import transformers

    out = Path(out_dir)
    tokenizer, vocab_size = _tokenizer(family)
    tiny = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4 if family == "modernbert" else 2,
                num_attention_heads=4, intermediate_size=64, initializer_range=0.3,
                max_position_embeddings=66 if family == "xlm-roberta" else 64)
    shape = {**tiny, **shape}
    if family == "bert":
        config = transformers.BertConfig(type_vocab_size=2, **shape)
    elif family == "modernbert":
        config = transformers.ModernBertConfig(local_attention=8, classifier_pooling=pooling, pad_token_id=0,
                                               cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3, **shape)
    else:
        config = transformers.XLMRobertaConfig(type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                               **shape)
    torch.manual_seed(seed)
    if num_labels is None:
        model = transformers.AutoModel.from_config(config)
    else:
        config.num_labels = num_labels
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    model.eval().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if num_labels is None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        (out / "modules.json").write_text(json.dumps(modules))
        (out / "1_Pooling").mkdir(exist_ok=True)
        (out / "2_Normalize").mkdir(exist_ok=True)
        (out / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
             "pooling_mode_mean_tokens": pooling == "mean"}))
    return out


def build_tiny_embedding_gemma(out_dir: str | Path, tokenizer_dir: str | Path) -> Path:
    """A tiny EmbeddingGemma, saved by sentence-transformers as the hub
    ships it: a Gemma 3 decoder trained to attend both ways
    (Gemma3TextModel, use_bidirectional_attention; sliding layers of a
    window of 8, 4 tokens either side, shorter than a long text), mean
    pooling, two Dense layers, Normalize. `tokenizer_dir`'s tokenizer, without its chat template."""
    import transformers
    from sentence_transformers import SentenceTransformer, models

    out = Path(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    # Without a chat template, which sentence-transformers would wrap each text in.
    tokenizer.chat_template = None
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=8, max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], use_bidirectional_attention=True,
        initializer_range=0.2, pad_token_id=tokenizer.pad_token_id or 0, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.Gemma3TextModel(config).eval().save_pretrained(out / "decoder", safe_serialization=True)
    tokenizer.save_pretrained(out / "decoder")
    identity = torch.nn.Identity()
    modules = [models.Transformer(str(out / "decoder")), models.Pooling(32, "mean"),
               models.Dense(32, 64, bias=False, activation_function=identity),
               models.Dense(64, 32, bias=True, activation_function=identity), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(out / "model"))
    return out / "model"
