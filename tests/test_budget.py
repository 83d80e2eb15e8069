"""auto(): the least-recompute policy that fits, checked against an exhaustive search on tiny."""

import dataclasses

import pytest

from remat_kit import _jax_internals
from remat_kit import policies as P
from remat_kit.analysis import memory
from remat_kit.analysis.memory import CompiledMemory
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import budget as A
from remat_kit.planning import builtin, fit, limits, pareto
from remat_kit.planning import planner as planner_lib
from remat_kit.planning.planner import Budget
from remat_kit.units import fmt_bytes

pytestmark = pytest.mark.onejax  # orchestration over compiles: the default JAX only (pyproject)

CFG = TransformerConfig.preset("tiny", num_layers=4)
POOL = ("none", "selective:q_proj,k_proj,v_proj", "every_n:2", "full", "sqrt_n")
BATCH, SEQ = 2, 32


@pytest.fixture(scope="module")
def planner():
    return builtin.Planner(CFG)


@pytest.fixture(scope="module")
def needs(planner):
    return {p: planner.memory(P.parse(p), BATCH, SEQ)[0] for p in POOL}


def _auto(planner, budget, **kw):
    # Untiled: these tests are about the policies; sequence tiles, tried when nothing fits, are tested on their own.
    kw = {"tiles": (), **kw}
    return fit.auto(CFG, batch=BATCH, seq=SEQ, budget_bytes=int(budget), candidates=POOL, planner=planner, **kw)


def _budgets(needs):
    """Budgets just above each candidate's need (with the margin) and one above all."""
    return [*sorted(int(n * (1 + planner_lib.DEFAULT_MARGIN)) + 1 for n in needs.values()), 10**10]


def test_chosen_fits_and_nothing_fitting_recomputes_less(planner, needs):
    for budget in _budgets(needs):
        r = _auto(planner, budget, exhaustive=True)
        win = next(c for c in r.candidates if c.policy == str(r.chosen))
        assert win.fits and win.need_bytes * (1 + r.margin) <= budget
        cheaper = [c for c in r.candidates if c.fits and c.rank < win.rank]  # by the cost model's estimate
        assert cheaper == []
        ties = [c for c in r.candidates if c.fits and c.rank == win.rank]
        assert all(win.need_bytes <= c.need_bytes for c in ties)


def test_search_agrees_with_exhaustive(planner, needs):
    for budget in _budgets(needs):
        assert _auto(planner, budget).chosen == _auto(planner, budget, exhaustive=True).chosen


def test_search_stops_at_the_cheapest_fitting_group():
    fast = _auto(builtin.Planner(CFG), 10**10)  # ample: the zero-recompute group fits at once
    assert fast.compiled < len(POOL)
    assert [c.fits for c in fast.candidates if c.need_bytes is None] == [None] * (len(POOL) - fast.compiled)


def test_larger_budget_never_recomputes_more(planner, needs):
    recomputes = []
    for budget in _budgets(needs):
        r = _auto(planner, budget)
        recomputes.append(next(c.cost_s for c in r.candidates if c.policy == str(r.chosen)))
    assert recomputes == sorted(recomputes, reverse=True)
    assert recomputes[-1] == 0  # enough for everything: nothing recomputed


def test_nothing_fits_says_what_is_needed_and_the_levers(planner, needs):
    least = min(needs.values())
    r = _auto(planner, least // 2)
    assert r.chosen is None
    assert f"needs {fmt_bytes(least)}" in r.reason and f"budget is {fmt_bytes(least // 2)}" in r.reason
    assert "chunked loss" in r.reason and "offload" in r.reason and "smaller batch" in r.reason
    assert r.to_dict()["chosen"] is None


def test_margin_is_applied(planner, needs):
    budget = needs["none"] + 1
    assert _auto(planner, budget, margin=0.0).candidates[0].fits
    assert not _auto(planner, budget, margin=0.5).candidates[0].fits


@pytest.mark.parametrize("dim", ["seq", "batch"])
def test_max_fit_is_exact(planner, dim):
    policy = P.full()
    budget = (
        int(planner.memory(policy, BATCH, 64 if dim == "seq" else SEQ)[0] * 1.1 * 1.3)
        if dim == "seq"
        else int(planner.memory(policy, 6, SEQ)[0] * 1.1)
    )
    before = planner.compiles
    n = builtin.max_fit(CFG, policy, dim=dim, batch=BATCH, seq=SEQ, budget_bytes=budget, planner=planner)
    # The speed of plan --budget, guarded by a count: the line (or the limit and a parabola) names the
    # answer, and the answer and one more are compiled to confirm it.
    assert planner.compiles - before <= (3 if dim == "batch" else 5)
    shape = (lambda k: (BATCH, k)) if dim == "seq" else (lambda k: (k, SEQ))
    assert n >= 1
    assert planner.fits(policy, *shape(n), Budget(budget))
    if n < (CFG.max_seq_len if dim == "seq" else 2**20):
        assert not planner.fits(policy, *shape(n + 1), Budget(budget))


def test_max_fit_returns_zero_when_even_one_does_not_fit(planner):
    assert builtin.max_fit(CFG, "full", dim="batch", batch=BATCH, seq=SEQ, budget_bytes=1000, planner=planner) == 0


def test_max_fit_stops_at_the_models_maximum(planner):
    n = builtin.max_fit(CFG, "full", dim="seq", batch=1, seq=64, budget_bytes=10**10, planner=planner)
    assert n == CFG.max_seq_len


def test_candidates_cover_the_policy_families():
    cfg = TransformerConfig.preset("tiny", num_layers=9)
    specs = [str(p) for p in builtin.candidates_for(cfg, offload=True)]
    assert len(specs) == len(set(specs))
    kinds = {P.parse(s).kind for s in specs}
    assert kinds == {"none", "selective", "dots", "every_n", "segments", "sqrt_n", "full", "offload"}
    assert not any(P.parse(s).kind == "offload" for s in builtin.candidates_for(cfg, offload=False))
    assert all(p.period <= 4 for p in builtin.candidates_for(CFG) if p.kind == "every_n")  # never deeper than the model


def test_offload_candidates_follow_what_jax_can_offload(monkeypatch):
    # A JAX whose remat cannot offload (jax 0.10's remat3) gets no offload candidates by default.
    cfg = TransformerConfig.preset("tiny")
    monkeypatch.setattr(_jax_internals, "offload_supported", lambda: False)
    assert not memory.host_offload().available
    assert not any(p.kind == "offload" for p in builtin.candidates_for(cfg))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GB", 80 * 10**9), ("24 GiB", 24 * 2**30), ("1.5e9", 1_500_000_000), ("512MiB", 512 * 2**20), (4096, 4096)],
)
def test_parse_bytes(text, expected):
    assert A.parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: A.parse_bytes("80 GX"), ValueError, r"cannot read memory size '80 GX'.*GiB"),
        (lambda: A.parse_bytes("0GB"), ValueError, r"must be positive"),
        (lambda: A.parse_bytes(True), TypeError, r"string or an int"),
        (lambda: planner_lib.get_optimizer("adamx"), ValueError, r"unknown optimizer 'adamx'; allowed: adamw"),
        (lambda: fit.auto(CFG, batch=2, seq=32, budget_bytes=-1), ValueError, r"budget_bytes must be a positive"),
        (
            lambda: fit.auto(CFG, batch=2, seq=32, budget_bytes=10, margin=1.5),
            ValueError,
            r"margin must be in \[0, 1\)",
        ),
        (lambda: fit.auto(CFG, batch=0, seq=32, budget_bytes=10), ValueError, r"batch must be a positive integer"),
        (lambda: fit.auto(CFG, batch=2, seq=999, budget_bytes=10), ValueError, r"seq=999 exceeds"),
        (
            lambda: builtin.max_fit(CFG, "full", dim="depth", batch=2, seq=32, budget_bytes=10),
            ValueError,
            r"dim must be",
        ),
    ],
    ids=["unit", "zero", "bool", "optimizer", "budget", "margin", "batch", "seq", "dim"],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_mesh_bytes_are_per_device():
    single = builtin.Planner(CFG).memory(P.full(), 8, SEQ)[0]
    data = builtin.Planner(CFG, mesh="data=4").memory(P.full(), 8, SEQ)[0]
    fsdp = builtin.Planner(CFG, mesh="fsdp=4").memory(P.full(), 8, SEQ)[0]
    assert data < single and fsdp < data  # activations split 4 ways; with fsdp the state too
    with pytest.raises(ValueError, match=r"batch 6 is not divisible by the data-parallel device count 4"):
        builtin.Planner(CFG, mesh="data=4").memory(P.full(), 6, SEQ)


def test_pareto_front():
    assert pareto.pareto_front([(0, 5), (1, 4), (1, 6), (2, 4), (3, 1)]) == [0, 1, 4]


def test_pareto_plot_is_a_png(planner, needs, tmp_path):
    r = _auto(planner, sorted(needs.values())[2] * 1.2, exhaustive=True)
    path = r.plot(str(tmp_path / "pareto.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("need", "degree", "most"),
    [
        (lambda n: 1000 + 37 * n, 1, 4),
        (lambda n: 1000 + 37 * n + (n % 3), 1, 4),
        (lambda n: 5000 if n == 1 else 1000 + 37 * n, 1, 4),
        (lambda n: 1000 + 37 * n + 64 * (n // 16), 1, 5),  # steps, like XLA's padding
        (lambda n: 1000 + 3 * n + n * n // 40, 2, 5),  # attention's quadratic term in the sequence length
    ],
    ids=["affine", "wobbles", "odd-at-one", "steps", "quadratic"],
)
def test_boundary_search_is_exact_and_cheap(need, degree, most):
    calls = []

    def counted(n):
        calls.append(n)
        return need(n)

    target = need(50) + 0.5
    cap = 2**20 if degree == 1 else 4096
    known = {} if degree == 1 else {cap: need(cap)}
    probes = (2, 4) if degree == 1 else (32, 64)
    answer = limits.boundary(counted, target, 1, cap, probes=probes, degree=degree, known=known)
    assert answer == 50
    assert 50 in calls and 51 in calls  # the answer and one more were measured, not inferred
    assert len(calls) == len(set(calls)) <= most  # the line (or parabola) names the answer; two compiles confirm


def test_cpu_plan_compiles_give_the_same_bytes_as_default_compiles(planner):
    # The planner compiles at LLVM -O0 on CPU to halve the time; the figures must be XLA's default ones.
    assert planner.compiler_options == planner_lib.CPU_PLAN_COMPILER_OPTIONS
    fast = planner.compiled_memory(P.full(), BATCH, SEQ)
    default = planner._trace(P.full(), BATCH, SEQ).lower().compile()
    assert fast == CompiledMemory.from_compiled(default)


def test_pareto_plot_labels_stay_apart_and_inside_the_figure(tmp_path, monkeypatch):
    # Sixteen candidates in clusters (as the tiny preset's are): equal points, near points, long specs.
    from matplotlib.figure import Figure

    specs = [
        "none",
        "selective",
        "selective:q_proj,k_proj,v_proj,attn_out,mlp_gate,mlp_up,mlp_out",
        "dots",
        "offload:q_proj,k_proj,v_proj,attn_out,mlp_gate,mlp_up,mlp_out",
        "every_n:4",
        "selective:mlp_gate,mlp_up",
        "every_n:2",
        "every_n:3",
        "selective:q_proj,k_proj,v_proj,attn_out",
        "selective:q_proj,k_proj,v_proj",
        "offload:q_proj,k_proj,v_proj",
        "full",
        "offload",
        "sqrt_n",
        "segments:2",
    ]
    points = [
        (0, 5.0),
        (0, 4.7),
        (2.1, 4.6),
        (2.1, 4.6),
        (2.1, 4.6),
        (5.0, 6.0),
        (8.4, 4.4),
        (10.0, 4.8),
        (10.0, 5.8),
        (13.6, 4.4),
        (15.7, 4.4),
        (15.7, 4.4),
        (19.9, 4.4),
        (19.9, 4.4),
        (25.7, 5.7),
        (25.0, 5.6),
    ]
    cands = tuple(
        A.Candidate(s, int(x * 1e6), int(x * 1e6), int(y * 1e6), 0, True)
        for s, (x, y) in zip(specs, points, strict=True)
    )
    r = A.AutoResult(P.parse("selective"), 50_000_000, 0.1, 2, 32, 0, "adamw", cands, "", 16, 1.0)
    seen = {}
    real = Figure.savefig

    def savefig(fig, *args, **kwargs):
        real(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        seen["figure"] = fig.bbox
        seen["ylabel"] = ax.yaxis.label.get_window_extent(renderer)
        seen["labels"] = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts]

    monkeypatch.setattr(Figure, "savefig", savefig)
    r.plot(str(tmp_path / "p.png"))
    fig, ylabel = seen["figure"], seen["ylabel"]
    assert fig.x0 <= ylabel.x0 and fig.y0 <= ylabel.y0 and ylabel.y1 <= fig.y1, (ylabel, fig)  # not cut off
    labels = seen["labels"]
    assert sorted(int(n) for text, _ in labels for n in text.split(",")) == list(range(1, 17))  # each point named
    for i, (a, box_a) in enumerate(labels):
        for b, box_b in labels[i + 1 :]:
            assert not box_a.overlaps(box_b), (a, b)


def test_auto_plans_sequence_tiles_when_nothing_fits_untiled():
    cfg = TransformerConfig.preset("tiny", max_seq_len=64)
    untiled, tiled = builtin.Planner(cfg), builtin.Planner(dataclasses.replace(cfg, seq_tiles=4))
    full = {k: p.memory(P.full(), 2, 64)[0] for k, p in ((1, untiled), (4, tiled))}
    assert full[4] < full[1]  # 4 tiles shrink full's recompute working set at 2 x 64
    budget = int((full[1] + full[4]) / 2 * (1 + planner_lib.DEFAULT_MARGIN))
    kw = {"batch": 2, "seq": 64, "budget_bytes": budget, "candidates": ("none", "full"), "mixes": False}
    r = fit.auto(cfg, planner=untiled, tiles=(4,), **kw)
    assert (str(r.chosen), r.seq_tiles) == ("full", 4) and r.reason.startswith("Nothing fits untiled; in 4 sequence")
    won = next(c for c in r.candidates if r.is_chosen(c))
    assert won.need_bytes == full[4] and won.fits and won.tiles_s > 0
    assert r.to_dict()["seq_tiles"] == 4 and "*full @4 tiles" in "\n".join(r.table())
    assert fit.auto(cfg, planner=untiled, tiles=(), **kw).chosen is None  # the lever is the tiles, nothing else
