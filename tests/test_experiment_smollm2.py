"""SmolLM2-135M experiment: text batches, loss, timing helper and the model's symmetry structure.

The sharpness measurements themselves need the full-symmetry measures; the loading test is slow
(the GGUF file is dequantised on load, about a minute and a half on a shared 2-core machine).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from quotient_manifolds.experiments import registry, smollm2


class _Tokenizer:
    """Whitespace 'tokenizer': one id per word (enough to test the batching)."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + (hash(w) % 97) for w in text.split()]}


def test_make_batches_cuts_one_stream_into_windows():
    tok = _Tokenizer()
    batches = smollm2.make_batches(tok, 2, 3, 5)
    assert len(batches) == 2
    stream = []
    for s in smollm2.SENTENCES:
        stream += tok(s)["input_ids"] + [0]
    flat = torch.cat([b["input_ids"].reshape(-1) for b in batches]).tolist()
    assert flat == stream[:30]
    for b in batches:
        assert b["input_ids"].shape == (3, 5) and b["input_ids"].dtype == torch.long
        assert torch.equal(b["labels"], b["input_ids"]) and b["labels"] is not b["input_ids"]
    with pytest.raises(ValueError, match="tokens"):
        smollm2.make_batches(tok, 100, 100, 100)


def test_registered():
    assert registry.EXPERIMENTS["smollm2"] == "smollm2"
    assert registry.load("smollm2") is smollm2.run


@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("gguf")
    try:
        smollm2.model_dir()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    torch.set_num_threads(1)
    return smollm2.load_model(torch.float32)


@pytest.mark.slow
def test_smollm2_loads_and_computes_its_loss(smol):
    model, tok = smol
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and not model.training
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    batches = smollm2.make_batches(tok, 2, 4, 32)
    with torch.no_grad():
        loss = float(smollm2.loss_fn(model, batches[0]))
    assert math.isfinite(loss) and 1.0 < loss < 10.0  # a trained model on plain English
    assert smollm2.forward_backward_seconds(model, batches[0], repeats=1) > 0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_smollm2_folds(smol):
    """60 RMSNorm folds (two per layer); the final norm feeds the tied head: a fallback."""
    from quotient_manifolds.models import find_folds

    model, _ = smol
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    folds, fallbacks = find_folds(model, [])
    assert Counter(f.kind for f in folds) == {"norm_gain": 60}
    assert [(fb.module, "tied" in fb.reason) for fb in fallbacks] == [("model.norm", True)]
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
