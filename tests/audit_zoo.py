"""Very small models with an output head (logits first), for the symmetry audit: its cost is a
singular value decomposition of a Jacobian with one column per parameter entry, so the widths
are 8 and the vocabularies 16 (about 1-3 thousand entries). Weights redrawn (HF's 0.02
initialisation makes attention uniform and hides symmetries that are not there)."""

from __future__ import annotations

import os
import warnings

import torch
from model_zoo import redraw_
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
             vocab_size=16, max_position_embeddings=8, n_embd=8, n_layer=2, n_head=2,
             d_model=8, num_layers=2, num_heads=2, ffn_dim=16, encoder_layers=1,
             decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=16, decoder_ffn_dim=16, n_positions=8, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, decoder_start_token_id=0, num_key_value_heads=2,
             d_kv=4, d_ff=16, head_dim=4, num_labels=3, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, attn_implementation="eager",
             tie_word_embeddings=False)

HF = {  # name: (model_type, auto class, extra config)
    "bert": ("bert", "AutoModelForSequenceClassification", {}),
    "roberta": ("roberta", "AutoModelForSequenceClassification", {"max_position_embeddings": 10}),
    "electra": ("electra", "AutoModelForSequenceClassification", {"embedding_size": 8}),
    "distilbert": ("distilbert", "AutoModelForSequenceClassification",
                   {"dim": 8, "n_layers": 2, "n_heads": 2, "hidden_dim": 16}),
    "gpt2": ("gpt2", "AutoModelForCausalLM", {"tie_word_embeddings": True}),
    "gpt2_untied": ("gpt2", "AutoModelForCausalLM", {}),
    # parallel blocks: with 16 tokens the first block's MLP, which reads the token alone, is a
    # table of 16 x 8 values with 280 parameters (200 flat directions of the vocabulary, not of
    # the architecture); 64 tokens make the table larger than the MLP
    "gpt_neox": ("gpt_neox", "AutoModelForCausalLM", {"rotary_pct": 1.0, "vocab_size": 64}),
    "llama": ("llama", "AutoModelForCausalLM", {}),
    "llama_gqa": ("llama", "AutoModelForCausalLM", {"num_attention_heads": 4, "num_heads": 4,
                                                   "num_key_value_heads": 2, "head_dim": 2}),
    "llama_tied": ("llama", "AutoModelForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("mistral", "AutoModelForCausalLM", {}),
    "qwen2": ("qwen2", "AutoModelForCausalLM", {}),
    "qwen3": ("qwen3", "AutoModelForCausalLM", {}),
    "gemma": ("gemma", "AutoModelForCausalLM", {}),
    "phi": ("phi", "AutoModelForCausalLM", {"partial_rotary_factor": 0.5, "vocab_size": 64}),
    "opt": ("opt", "AutoModelForCausalLM", {"word_embed_proj_dim": 8}),
    "bloom": ("bloom", "AutoModelForCausalLM", {}),
    "olmo": ("olmo", "AutoModelForCausalLM", {}),
    "stablelm": ("stablelm", "AutoModelForCausalLM", {"partial_rotary_factor": 0.5}),
    "t5": ("t5", "AutoModelForSeq2SeqLM", {"num_decoder_layers": 1, "num_layers": 1}),
    "bart": ("bart", "AutoModelForSeq2SeqLM", {}),
    "vit": ("vit", "AutoModelForImageClassification",
            {"image_size": 4, "patch_size": 2, "num_channels": 1}),
}


def hf(name: str) -> nn.Module:
    import transformers

    model_type, auto, extra = HF[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.AutoConfig.for_model(model_type, **{**SMALL, **extra})
        torch.manual_seed(0)
        model = getattr(transformers, auto).from_config(cfg)
    return redraw_(model.double().eval())


class EncoderClassifier(nn.Module):
    """`nn.TransformerEncoder` (post-norm, ReLU) over token embeddings, mean-pooled."""

    def __init__(self, norm_first: bool = False):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(8) if norm_first else nn.Identity()
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.norm(self.encoder(self.emb(ids))).mean(1))


def torch_encoder(norm_first: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return redraw_(EncoderClassifier(norm_first).double().eval())


def torch_inputs():
    return (torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0)),)


ZOO = {**{n: (lambda n=n: hf(n)) for n in HF},
       "torch_encoder": (lambda: torch_encoder(False)),
       "torch_encoder_prenorm": (lambda: torch_encoder(True))}
