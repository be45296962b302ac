"""Cost of the subgroup (RoPE commutant) projection versus the full-GL(h) projection.

Two shapes, both with head dimension ``h = 64``:

* **llama** — SmolLM2-135M (Llama type, GQA, full rotary): 30 layers × 3 key/value heads; a
  Q/K block stacks the 3 query heads that share a key head (``G``: 3·576 rows, ``H``: 576),
  a V/O block stacks the 3 output slices (``G``: 576, ``H``: 3·576).  Q/K subalgebra: the
  rotate-half commutant, ``dim k = 64``.
* **neox** — Pythia-160m (GPT-NeoX, ``rotary_pct = 0.25``): 12 layers × 12 heads, every
  factor 768 rows + the bias row.  Q/K subalgebra: 8 rotary pairs plus ``gl(48)`` on the
  unrotated dimensions, ``dim k = 2320``.

For each shape and metric the script times, on ``--threads`` threads (default 1), in the
working dtype float32 with float64 Gram algebra (what the sharpness engine runs):

* ``project``: one projection of all Q/K blocks with the base point's cache built
  (``gl.project`` with its Sylvester basis vs ``subgroup.project`` with its system) — what an
  APGD iteration pays, since every projection of a sharpness call is at the same base point;
* ``setup``: building that cache (``gl.sylvester_basis`` vs ``subgroup.subgroup_system``),
  paid once per call (and on every step of a geoopt optimizer, which moves the point);
* ``iteration``: the geometry of one APGD iteration on every block of the model — Q/K and
  V/O blocks, two projections (gradient and ball) and one ``egrad2rgrad`` each, and the
  second-order retraction's Christoffel form — plus, unless ``--no-model``, one forward and
  backward pass of the model itself (random weights from the config, batch ``--batch`` ×
  ``--seq`` tokens).  The subgroup iteration differs from the GL one only in the Q/K
  projections.  Ratio: ``(forward/backward + geometry with subgroup) / (forward/backward +
  geometry with GL)``; the budget is 1.10.  Because the two geometry timings are each long and
  noisy on a loaded machine, the table also shows the ratio implied by the projection timings
  alone, ``1 + 2 (sub_project − gl_project) / (forward/backward + GL geometry)`` (two Q/K
  projections per iteration), which is less exposed to that noise.

Timing: the GL and subgroup variants of each figure alternate, ``--repeats`` times, and each
figure is the minimum process CPU time (``time.process_time``), which other load on a shared
machine inflates least.  Before timing, each subgroup projection is checked against a dense
solve of the same linear system (``max_rel_err``).

Usage::

    .venv/bin/python benchmarks/subgroup_ops.py [--shapes llama neox] [--repeats 5]
        [--layers N] [--no-model] [--json runs/subgroup_ops.json]

``--layers 2 --no-model --repeats 2`` is a seconds-long smoke run.  JSON keys:
``{shape}_{metric}_{what}`` with ``what`` in ``gl_project_s``, ``sub_project_s``,
``project_ratio``, ``gl_setup_s``, ``sub_setup_s``, ``setup_ratio``, ``gl_geometry_s``,
``sub_geometry_s``, ``forward_backward_s``, ``iteration_ratio``,
``iteration_ratio_from_projection``, ``max_rel_err``; plus
``config_*`` and ``env_*``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, fmt, load_average, print_table, write_json  # noqa: E402

from quotient_manifolds.geometry import gl  # noqa: E402
from quotient_manifolds.geometry import subgroup as sg  # noqa: E402

H_DIM = 64
SHAPES = {
    # name: layers, kv heads per layer, (n, m) of Q/K, (n, m) of V/O, rotary dims, model config
    "llama": dict(layers=30, heads=3, qk=(3 * 576, 576), vo=(576, 3 * 576), rotary=64),
    "neox": dict(layers=12, heads=12, qk=(769, 769), vo=(769, 769), rotary=16),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--metrics", nargs="+", choices=gl.METRICS, default=list(gl.METRICS))
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-model", action="store_true", help="skip the forward/backward pass")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None)
    args = p.parse_args(argv)
    if args.repeats < 1 or (args.layers is not None and args.layers < 1):
        p.error("--repeats and --layers must be positive")
    return args


def min_cpu(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Minimum process CPU time of each function, the functions alternating, after a warm-up."""
    for f in fns.values():
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            c0 = time.process_time()
            f()
            best[k] = min(best[k], time.process_time() - c0)
    return best


def factors(blocks: int, n: int, m: int, gen: torch.Generator):
    """A base point and two tangent vectors of ``blocks`` blocks, float32, like trained heads."""
    G = torch.randn(blocks, n, H_DIM, generator=gen) / n**0.5
    H = torch.randn(blocks, m, H_DIM, generator=gen) / m**0.5
    u = (torch.randn(blocks, n, H_DIM, generator=gen), torch.randn(blocks, m, H_DIM, generator=gen))
    return G, H, u


def dense_check(G, H, u, gr, metric, sub, blocks: int = 2) -> float:
    """``max |X − X_dense| / max |X_dense|``: the structured solve against a dense solve of
    ``π_k(D(ξ) + L(X)) = 0`` in an orthonormal basis of k (first ``blocks`` blocks)."""
    B = sub.basis()
    err = 0.0
    for i in range(blocks):
        gri = gl.Grams(*(t[i] if isinstance(t, torch.Tensor) else t for t in gr))
        X = sg.horizontal_x(G[i], H[i], u[0][i], u[1][i], gri, metric, sub)
        R = sg.vertical_dual(G[i], H[i], u[0][i], u[1][i], gri, metric)
        LB = torch.stack([sg.dual_operator(b, gri, metric) for b in B])
        A = torch.einsum("aij,bij->ab", B, LB)
        c = torch.linalg.solve(A, -torch.einsum("aij,ij->a", B, R))
        ref = torch.einsum("a,aij->ij", c, B)
        err = max(err, float((X - ref).abs().max() / ref.abs().max()))
    return err


def model_forward_backward(shape: str, layers: int, batch: int, seq: int, seed: int):
    """A closure running one forward + backward of a random-weight model of the shape."""
    import transformers as tf

    torch.manual_seed(seed)
    if shape == "llama":
        cfg = tf.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                             max_position_embeddings=2048, tie_word_embeddings=True)
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.GPTNeoXConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=layers,
                               num_attention_heads=12, rotary_pct=0.25, vocab_size=50304,
                               max_position_embeddings=2048)
        model = tf.GPTNeoXForCausalLM(cfg)
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(
        seed))

    def run() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return run


def geometry_iteration(G, H, u, gr, metric, project: Callable) -> None:
    """Per block group: egrad2rgrad, two projections, the second-order Christoffel form."""
    rG, rH = gl.egrad2rgrad(*u, gr, metric)
    pG, pH = project(rG, rH)
    project(pG, pH)
    gl.christoffel(G, H, pG, pH, None, None, gr, metric)


def time_metric(qk, vo, metric: str, sub: sg.Subalgebra, repeats: int):
    """CPU times of the figures of one shape and metric, and the dense-check error."""
    G, H, u = qk
    gr = gl.grams(G, H)
    vG, vH, vu = vo
    vgr = gl.grams(vG, vH)
    basis = gl.sylvester_basis(gr, metric)
    vbasis = gl.sylvester_basis(vgr, metric)
    system = sg.subgroup_system(G, H, gr, metric, sub)
    err = dense_check(G.double(), H.double(), [t.double() for t in u],
                      gl.grams(G.double(), H.double()), metric, sub)

    def gl_qk(a, b):
        return gl.project(G, H, a, b, gr, metric, basis)

    def sub_qk(a, b):
        return sg.project(G, H, a, b, gr, metric, sub, system)

    def gl_vo(a, b):
        return gl.project(vG, vH, a, b, vgr, metric, vbasis)

    t = min_cpu({
        "gl_project": lambda: gl_qk(*u),
        "sub_project": lambda: sub_qk(*u),
        "gl_setup": lambda: gl.sylvester_basis(gr, metric),
        "sub_setup": lambda: sg.subgroup_system(G, H, gr, metric, sub),
        "gl_geometry": lambda: (geometry_iteration(G, H, u, gr, metric, gl_qk),
                                geometry_iteration(vG, vH, vu, vgr, metric, gl_vo)),
        "sub_geometry": lambda: (geometry_iteration(G, H, u, gr, metric, sub_qk),
                                 geometry_iteration(vG, vH, vu, vgr, metric, gl_vo)),
    }, repeats)
    return t, err


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    figures: dict[str, object] = dict(environment())
    figures.update({"config_repeats": args.repeats, "config_threads": args.threads,
                    "config_batch": args.batch, "config_seq": args.seq})
    rows = []
    for shape in args.shapes:
        cfg = SHAPES[shape]
        layers = args.layers or cfg["layers"]
        blocks = layers * cfg["heads"]
        sub = sg.RotaryCommutant.rotate_half(H_DIM, cfg["rotary"])
        figures[f"config_{shape}_blocks"] = blocks
        figures[f"config_{shape}_dim_k"] = sub.dim()
        qk = factors(blocks, *cfg["qk"], gen)
        vo = factors(blocks, *cfg["vo"], gen)
        fb = None
        if not args.no_model:
            run = model_forward_backward(shape, layers, args.batch, args.seq, args.seed)
            fb = min_cpu({"fb": run}, max(1, args.repeats // 2))["fb"]
        for metric in args.metrics:
            t, err = time_metric(qk, vo, metric, sub, args.repeats)
            key = f"{shape}_{metric}"
            it_gl = t["gl_geometry"] + (fb or 0.0)
            it_sub = t["sub_geometry"] + (fb or 0.0)
            fig = {
                "gl_project_s": t["gl_project"], "sub_project_s": t["sub_project"],
                "project_ratio": t["sub_project"] / t["gl_project"],
                "gl_setup_s": t["gl_setup"], "sub_setup_s": t["sub_setup"],
                "setup_ratio": t["sub_setup"] / t["gl_setup"],
                "gl_geometry_s": t["gl_geometry"], "sub_geometry_s": t["sub_geometry"],
                "forward_backward_s": fb, "iteration_ratio": it_sub / it_gl,
                "iteration_ratio_from_projection":
                    1 + 2 * (t["sub_project"] - t["gl_project"]) / it_gl,
                "max_rel_err": err,
            }
            figures.update({f"{key}_{k}": v for k, v in fig.items()})
            rows.append([shape, metric, str(blocks), str(sub.dim()),
                         fmt(1e3 * t["gl_project"]), fmt(1e3 * t["sub_project"]),
                         fmt(fig["project_ratio"], ".2f"), fmt(1e3 * t["gl_setup"]),
                         fmt(1e3 * t["sub_setup"]), fmt(fig["setup_ratio"], ".2f"),
                         fmt(None if fb is None else 1e3 * fb),
                         fmt(fig["iteration_ratio"], ".3f"),
                         fmt(fig["iteration_ratio_from_projection"], ".3f"), fmt(err, ".1e")])
    figures["env_loadavg_end"] = load_average()
    print_table(
        ["shape", "metric", "blocks", "dim k", "GL proj ms", "sub proj ms", "proj ratio",
         "GL setup ms", "sub setup ms", "setup ratio", "fwd+bwd ms", "iteration ratio",
         "(from proj)", "rel err"],
        rows,
        title=f"Subgroup vs GL(h) projection, {args.threads} thread(s), CPU ms (min of "
              f"{args.repeats}); load {figures['env_loadavg_start']:.2f} -> "
              f"{figures['env_loadavg_end']:.2f}",
    )
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
