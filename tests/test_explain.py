"""What is live at the compiled peak, the memory timeline and the guardrails (remat_kit/explain.py), compile-only,
on users' models (a Linen nn.scan stack and an NNX stack), the built-in model and tiny functions."""

import re

import jax
import jax.numpy as jnp
import plan_model_factory as M
import pytest
from jax.ad_checkpoint import checkpoint_name
from test_inspect import _nnx_loss_and_args

import remat_kit
from remat_kit import policies
from remat_kit.analysis import explain
from remat_kit.cli import main
from remat_kit.model.transformer import TransformerConfig
from remat_kit.planning import analysis

F32 = 4


def _param_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _linen(spec, batch=64):
    return M.make(policies.parse(spec), batch=batch)


def _nnx(spec):
    return _nnx_loss_and_args(policies.parse(spec), layers=3, batch=32, seq=8, d=16)


MODELS = {"linen_scan": _linen, "nnx": _nnx}


@pytest.fixture(scope="module", params=sorted(MODELS), ids=sorted(MODELS))
def reports(request):
    make = MODELS[request.param]
    out = {}
    for spec in ("none", "full"):
        loss, args = make(spec)
        out[spec] = (remat_kit.inspect(loss, *args, explain=True, policy=spec), args)
    return out


def test_groups_at_the_peak_sum_to_the_compiled_peak(reports):
    for spec, (r, args) in reports.items():
        assert set(r.at_peak) <= set(explain.GROUPS), r.at_peak
        assert sum(r.at_peak.values()) == r.peak_bytes, spec
        # 'reserved' (held by XLA, used by no value at the peak) stays under the stated tolerance.
        assert r.at_peak.get("reserved", 0) <= explain.RESERVED_TOLERANCE * r.peak_bytes, (spec, r.at_peak)
        # Every parameter is live at the peak, to the byte.
        assert r.at_peak["parameters"] == _param_bytes(args[0]), spec


def test_remat_shrinks_the_saved_residuals_at_the_peak(reports):
    none, full = reports["none"][0], reports["full"][0]
    assert none.at_peak["saved residuals"] > 0
    assert full.at_peak.get("saved residuals", 0) < none.at_peak["saved residuals"]
    assert full.peak_bytes < none.peak_bytes


def test_the_ten_largest_buffers_are_named(reports):
    for spec, (r, _) in reports.items():
        rows = r.largest_at_peak
        assert len(rows) == 10, spec
        assert [b.nbytes for b in rows] == sorted((b.nbytes for b in rows), reverse=True)
        for b in rows:
            assert b.group in explain.GROUPS and b.producer, b
            n = 1
            for d in b.shape:
                n *= d
            assert b.nbytes == n * {"float32": 4, "int32": 4, "bool": 1}[b.dtype], b
        record = r.to_dict()
        assert record["at_peak"] == r.at_peak and len(record["largest_at_peak"]) == 10


def test_the_timeline_peaks_at_the_live_bytes_and_plots(reports, tmp_path):
    r = reports["none"][0]
    tl = r.timeline
    assert tl.peak == r.peak_bytes - r.at_peak.get("reserved", 0)
    assert {"forward", "backward"} <= set(tl.phases)
    # The scan body repeats once per trip: the step is longer than the flattened sequence XLA lists.
    assert tl.phases.index("backward") > 0
    path = r.plot_timeline(str(tmp_path / "t.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_scan_body_is_drawn_once_per_trip():
    from remat_kit.analysis import _xla_dump
    from remat_kit.analysis.memory import CompiledMemory

    def layer(h, w):
        return jnp.tanh(h @ w), None

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    drawn = {}
    for trips in (2, 6):
        lowered = jax.jit(jax.value_and_grad(loss)).lower(jax.ShapeDtypeStruct((trips, 16, 16), jnp.float32), x)
        compiled, program = _xla_dump.compile_with_dump(lowered)
        e = explain.explain(program, CompiledMemory.from_compiled(compiled), parameter_groups={0: "parameters"})
        # The instructions of the loop bodies (forward and backward scan), listed once in XLA's sequence.
        body = sum(1 for i in program.sequence if i.computation in program.trips)
        assert body > 0 and len(e.timeline.live) == len(program.sequence) + (trips - 1) * body, trips
        drawn[trips] = (len(e.timeline.live), body)
    # The same program but for the trip count: four more trips draw the loop bodies exactly four more times.
    (short, body), (long, body_long) = drawn[2], drawn[6]
    assert body == body_long and long - short == (6 - 2) * body


def test_compare_plots_one_line_per_policy(tmp_path):
    c = remat_kit.compare(lambda p: M.make(p)[0], ["none", "full"], *M.make(policies.none())[1], explain=True)
    path = c.plot_timeline(str(tmp_path / "c.png"))
    with open(path, "rb") as f:
        assert f.read(4) == b"\x89PNG"
    loss, args = M.make(policies.none())
    with pytest.raises(ValueError, match="explain=True"):
        remat_kit.inspect(loss, *args).plot_timeline("x.png")


# ---- the guardrails -------------------------------------------------------------------------------


def _unrolled(policy):
    """Four layers in a Python loop: on CPU XLA merges full remat's recompute back into the forward pass."""

    def loss(ws, x):
        for i in range(4):
            layer = lambda h, w: jnp.tanh(h @ w)
            if str(policy) != "none":
                layer = jax.checkpoint(layer, prevent_cse=False)
            x = layer(x, ws[i])
        return jnp.sum(x**2)

    return loss


UNROLLED = (jax.ShapeDtypeStruct((4, 64, 64), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32))


def test_a_policy_that_did_nothing_is_named():
    c = remat_kit.compare(_unrolled, ["none", "full"], *UNROLLED, explain=True)
    assert c["full"].peak_bytes == c["none"].peak_bytes
    [w] = [w for w in c["full"].warnings if "did nothing" in w]
    assert "remat_kit.stack" in w and "'full'" in w
    assert not any("did nothing" in w for w in c["none"].warnings)
    assert "warning (full)" in c.table()


def test_a_policy_gets_one_guardrail_not_two():
    # Without the dump the compiled saved set is unknown: JAX's residuals drop, so only the CSE note can fire.
    plain = remat_kit.compare(_unrolled, ["none", "full"], *UNROLLED)
    assert not any("did nothing" in w for w in plain["full"].warnings)
    assert any("XLA removed" in n for n in plain["full"].notes)
    # With it the no-op warning fires, and the CSE note (the weaker claim) is left out.
    dumped = remat_kit.compare(_unrolled, ["none", "full"], *UNROLLED, explain=True)
    assert any("did nothing" in w for w in dumped["full"].warnings)
    assert not any("XLA removed" in n for n in dumped["full"].notes)


def test_a_working_policy_under_a_scan_gets_no_noop_warning():
    c = remat_kit.compare(
        lambda p: M.make(p, batch=64)[0], ["none", "full"], *M.make(policies.none(), batch=64)[1], explain=True
    )
    assert not any("did nothing" in w for r in c.reports for w in r.warnings)
    # Activations dominate at this batch: no lever beyond remat is named either.
    assert c["none"].warnings == ()


_OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device", offload_dst="pinned_host"
)


def _offloaded(w, x):
    return jax.checkpoint(lambda w, x: jnp.sum(jnp.sin(checkpoint_name(jnp.tanh(x @ w), "h"))), policy=_OFFLOAD)(w, x)


def test_offload_that_moves_nothing_is_named():
    r = remat_kit.inspect(
        _offloaded, jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((256, 64), jnp.float32)
    )
    offloaded = sum(x.nbytes for x in r.residuals if x.host)
    if offloaded:  # JAX's remat offloads here: on CPU the bytes stay on the device
        assert any("stay on the device" in w for w in r.warnings), r.warnings
    else:  # jax 0.10's remat3 recomputes instead of offloading: nothing to warn about here
        assert not any("stay on the device" in w for w in r.warnings)
    w, x = jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((256, 64), jnp.float32)
    plain = remat_kit.inspect(lambda w, x: jnp.sum(jnp.sin(jnp.tanh(x @ w))), w, x)
    assert plain.warnings == ()


@pytest.mark.parametrize(
    "warn, enforced, policy, xla_host, expect",
    [
        (0, True, True, 0, "nothing is saved"),
        (1024, False, True, 0, "stay on the device"),
        (1024, True, True, 0, "ignores"),
        (1024, True, True, 1024, None),
        (0, False, False, 0, None),
    ],
    ids=["remat-recomputes", "cpu", "ignored-destination", "moved", "no-offload"],
)
def test_offload_warning_cases(warn, enforced, policy, xla_host, expect):
    out = explain.offload_warnings(warn, enforced, policy, xla_host)
    assert (out == []) if expect is None else (expect in out[0])


def test_a_peak_of_state_names_the_levers():
    # One token, wide weights: parameters and gradients are most of the peak.
    loss, args = M.make(policies.none(), batch=1, seq=1, d=64)
    r = remat_kit.inspect(loss, *args, explain=True)
    [w] = [w for w in r.warnings if "no remat policy changes them" in w]
    # A report on the user's function speaks in API words: no CLI flag, no optimizer it does not have.
    assert "LoRA" in w and "mesh" in w and "--" not in w and "optimizer" not in w, w


def test_a_peak_of_logits_names_the_chunked_loss():
    def loss(w, h, labels):  # a wide vocabulary: the [tokens, V] logits dwarf everything
        logits = h @ w
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    args = (
        jax.ShapeDtypeStruct((16, 8192), jnp.float32),
        jax.ShapeDtypeStruct((512, 16), jnp.float32),
        jax.ShapeDtypeStruct((512,), jnp.int32),
    )
    r = remat_kit.inspect(loss, *args, explain=True)
    assert r.at_peak["logits / loss"] >= 512 * 8192 * F32
    assert any("a chunked loss" in w and "--" not in w for w in r.warnings), r.warnings  # API words


# ---- what the saved residuals at the peak are ------------------------------------------------------

BF16 = 2


def _bf16_residual_bytes(residuals) -> int:
    return sum(r.nbytes for r in residuals if str(r.dtype) == "bfloat16")


def _check_residual_groups(at_peak, largest, residuals, saved_bytes):
    """The residual groups at a bfloat16 model's peak say what they hold (XLA:CPU on jax 0.10 widens bfloat16
    residuals to float32 before the backward loop; jax 0.12's keeps them in bfloat16)."""
    # 'saved residuals' holds only values of a JAX residual's size and dtype: never more than JAX saves.
    assert at_peak.get("saved residuals", 0) <= saved_bytes, (at_peak, saved_bytes)
    widened = at_peak.get("residuals widened by XLA", 0)
    # Each widened buffer is one bfloat16 residual held as float32: twice its bytes, at most all of them.
    assert widened <= (F32 // BF16) * _bf16_residual_bytes(residuals), (at_peak, saved_bytes)
    bf16_shapes = {tuple(r.shape) for r in residuals if str(r.dtype) == "bfloat16"}
    for b in largest:
        if b.group == "residuals widened by XLA":
            assert b.dtype == "float32" and b.shape in bf16_shapes, b
            assert "convert bf16->f32 of " in b.producer, b
        else:  # XLA's converts of the forward's outputs are residuals, never temporaries
            assert "convert bf16->f32 of " not in b.producer, b
    # XLA's own fusions and casts carry no metadata: they are named by their root op or by what they move.
    raw = [b.producer for b in largest if re.search(r"fusion|wrapped_|^[\w\-]+\.\d+$", b.producer)]
    assert not raw, raw
    # The residuals at the peak counted at JAX's width (a widened one at half its bytes).
    return at_peak.get("saved residuals", 0) + widened * BF16 // F32


def test_the_built_in_model_names_the_residuals_xla_widened():
    # bfloat16 compute, tied embeddings and activations larger than the state, as on the 2B preset.
    cfg = TransformerConfig.preset("tiny", dtype="bfloat16", tie_embeddings=True)
    a = analysis.analyze(cfg, "none", batch=8, seq=128, explain=True)
    assert sum(a.at_peak.values()) == a.peak_bytes
    held = _check_residual_groups(a.at_peak, a.largest_at_peak, a.residuals, a.saved_bytes)
    # The scan's stacked residuals are allocated whole before the forward loop and live until the backward loop
    # reads them, so wherever the peak is they are all there, in one form or the other: JAX's saved bytes, from
    # the layer stack's to the whole step's (the loss's saved values may be dead at the peak).
    assert a.layers_saved_bytes <= held <= a.saved_bytes, (a.at_peak, a.layers_saved_bytes, a.saved_bytes)
    if "residuals widened by XLA" in a.at_peak:
        assert "saved residuals XLA converted to a wider dtype" in explain.format_at_peak(
            a.at_peak, a.largest_at_peak, a.peak_bytes
        )


def test_a_users_bfloat16_scan_names_the_residuals_xla_widened():
    loss, args = M.make(policies.none(), batch=64, dtype=jnp.bfloat16)
    r = remat_kit.inspect(loss, *args, explain=True)
    assert sum(r.at_peak.values()) == r.peak_bytes
    held = _check_residual_groups(r.at_peak, r.largest_at_peak, r.residuals, r.saved_bytes)
    # The stacked [layers, batch, seq, 4d] activations JAX saves are all live at the peak, in one form or another.
    stacked = sum(x.nbytes for x in r.residuals if x.shape == (M.LAYERS, 64, M.SEQ, 4 * M.D))
    assert stacked <= held <= r.saved_bytes, (r.at_peak, stacked, r.saved_bytes)


# ---- the built-in model and plan --explain ---------------------------------------------------------


def test_the_built_in_model_groups_sum_to_the_peak():
    cfg = TransformerConfig.preset("tiny")
    a = analysis.analyze(cfg, "none", batch=2, seq=16, explain=True)
    assert sum(a.at_peak.values()) == a.peak_bytes
    assert a.at_peak["parameters"] == a.param_bytes
    # AdamW keeps two moments per parameter (and a step count).
    assert 2 * a.param_bytes <= a.at_peak["optimizer state"] <= 2 * a.param_bytes + 64
    assert a.at_peak.get("reserved", 0) <= explain.RESERVED_TOLERANCE * a.peak_bytes
    assert len(a.largest_at_peak) == 10 and a.peak_at
    assert a.to_dict()["at_peak"] == a.at_peak


def test_plan_explain_prints_the_groups_and_writes_the_timeline(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    argv = [
        "plan",
        "--preset",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--policies",
        "none,full",
        "--explain",
        "--timeline",
        str(png),
        "--top",
        "0",
        "--no-progress",
        "--jobs",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("at the peak, ") == 2 and "optimizer state" in out and out.count("peak in ") == 2
    assert "warning (" in out  # the tiny model's peak is its state: the levers are named
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_model_explain_prints_the_groups_and_writes_the_timeline(tmp_path, capsys):
    png = tmp_path / "model.png"
    argv = ["plan", "--model", "plan_model_factory:factory", "--policies", "none,full", "--explain"]
    assert main([*argv, "--timeline", str(png), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.count("at the peak, ") == 2 and out.count(": peak in backward") == 2, out
    assert png.read_bytes()[:4] == b"\x89PNG"


# ---- a scanned user model names its tags at the peak -----------------------------------------------


def _tagged_stack(policy):
    """A tagged MLP block stacked by remat_kit.stack (one scan)."""
    import flax.linen as nn

    from remat_kit.names import tag

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = tag(nn.Dense(4 * x.shape[-1], use_bias=False, name="up")(x), "mlp_up")
            return x + nn.Dense(x.shape[-1], use_bias=False, name="down")(jnp.tanh(h))

    layers = remat_kit.stack(Mlp, M.LAYERS, policy)
    x = jax.ShapeDtypeStruct((M.BATCH, M.SEQ, M.D), jnp.float32)
    params = jax.eval_shape(lambda k: layers.init(k, jnp.zeros(x.shape))["params"], jax.random.key(0))
    return (lambda p, x: jnp.mean(layers.apply({"params": p}, x) ** 2)), (params, x)


def _tagged_linen_scan(policy):
    """The same block under a Linen nn.scan of the user's own."""
    import flax.linen as nn

    from remat_kit.names import tag

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = tag(nn.Dense(4 * x.shape[-1], use_bias=False, name="up")(x), "mlp_up")
            return x + nn.Dense(x.shape[-1], use_bias=False, name="down")(jnp.tanh(h)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = policy(Mlp, prevent_cse=False)
            scan = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=M.LAYERS)
            return jnp.mean(scan(name="blocks")(x, None)[0] ** 2)

    net = Net()
    x = jax.ShapeDtypeStruct((M.BATCH, M.SEQ, M.D), jnp.float32)
    params = jax.eval_shape(lambda k: net.init(k, jnp.zeros(x.shape))["params"], jax.random.key(0))
    return (lambda p, x: net.apply({"params": p}, x)), (params, x)


@pytest.mark.parametrize("make", [_tagged_stack, _tagged_linen_scan], ids=["remat_kit_stack", "linen_nn_scan"])
def test_a_scanned_models_residuals_carry_its_tags_at_the_peak(make):
    # JAX reports the scan's stacked residuals untagged; one trip of the scan body names them.
    loss, args = make(policies.parse("selective:mlp_up"))
    r = remat_kit.inspect(loss, *args, explain=True)
    stacked = (M.LAYERS, M.BATCH, M.SEQ, 4 * M.D)
    [up] = [x for x in r.residuals if x.shape == stacked]
    assert (up.label, up.tags, up.tag) == ("mlp_up", ("mlp_up",), None), up
    [held] = [b for b in r.largest_at_peak if b.shape == stacked]
    assert (held.group, held.producer) == ("saved residuals", "mlp_up"), held


# ---- the groups, host memory and 'reserved' on a synthetic program ----------------------------------


def _synthetic_program(host_bytes: int):
    """A two-instruction program: a parameter, a forward value and (with ``host_bytes``) a value in host memory."""
    from remat_kit.analysis import _xla_dump

    seq = (
        _xla_dump.Instruction("p0", "main", "parameter", "params['w']", "", parameter=0, dtype="f32", shape=(64,)),
        _xla_dump.Instruction("t1", "main", "tanh", "jit(f)/jvp()/tanh", "f.py:3", operands=("p0",), dtype="f32"),
    )

    def buf(name, nbytes, allocation, kind, color=0, parameter=None):
        return _xla_dump.Buffer(
            name, name, (nbytes // F32,), "f32", nbytes, allocation, 0, kind, color, parameter, False, 0, 1
        )

    buffers = [buf("p0", 256, 0, "parameter", parameter=0), buf("t1", 512, 1, "temp")]
    if host_bytes:
        buffers.append(buf("h2", host_bytes, 2, "temp", color=_xla_dump.HOST_COLOR))
        seq += (_xla_dump.Instruction("h2", "main", "copy", "jit(f)/jvp()/copy", "f.py:4", dtype="f32"),)
    allocations = {b.allocation: (b.nbytes, b.kind, b.color) for b in buffers}
    return _xla_dump.Program(seq, tuple(buffers), allocations, {}, {i.name: i for i in seq})


class _Memory:
    def __init__(self, total):
        self.total = total


@pytest.mark.parametrize("host", [0, 4096], ids=["device-only", "host-buffer"])
def test_host_memory_is_apart_and_the_device_groups_sum_to_the_peak(host):
    e = explain.explain(_synthetic_program(host), _Memory(1000), parameter_groups={0: "parameters"})
    assert sum(e.at_peak.values()) == e.total == 1000, e.at_peak
    assert explain.HOST_GROUP not in e.at_peak and e.host_bytes == host
    assert e.at_peak["reserved"] == 1000 - 256 - 512
    assert [b.host for b in e.largest_at_peak].count(True) == (1 if host else 0)
    table = explain.format_at_peak(e.at_peak, e.largest_at_peak, e.total, e.host_bytes)
    assert ("not in the device peak" in table) == bool(host)


def test_more_live_than_xla_counts_fails_loudly():
    from remat_kit.analysis import _xla_dump

    with pytest.raises(_xla_dump.DumpFormatError, match=r"768 device bytes are live .* counts 700"):
        explain.explain(_synthetic_program(0), _Memory(700), parameter_groups={0: "parameters"})


def test_a_reserved_share_above_the_tolerance_is_said():
    over = {"parameters": 256, "reserved": 744}
    assert "above the 10% tolerance" in explain.format_at_peak(over, (), 1000)
    assert "tolerance" not in explain.format_at_peak({"parameters": 950, "reserved": 50}, (), 1000)


# ---- the guardrails without XLA's dump ----------------------------------------------------------------

# The 2B preset at batch 2 x 1,024 (benchmarks/results/explain_2b.txt): 7.67 GB of parameters, 15.34 GB of AdamW
# moments and a 46.38 GB peak; its float32 gradients are the parameters' size again.
_2B = (7_670_000_000, 15_340_000_000, 7_670_000_000)


@pytest.mark.parametrize(
    "sizes, total, fires",
    [(_2B, 46_380_000_000, True), (_2B, 80_000_000_000, False), ((10, 0, 10), 100, False)],
    ids=["2b-state-dominates", "2b-activations-dominate", "small-state"],
)
def test_the_state_warning_needs_no_dump(sizes, total, fires):
    # What bench's records carry: analysis and inspect without explain estimate the state by its size.
    out = explain.dominance_warnings(
        explain.state_at_peak(*sizes), total, has_optimizer=True, estimated=True, levers=explain.CLI_LEVERS
    )
    assert bool(out) == fires, out
    if fires:
        assert out[0].startswith("the peak is about 66% parameters") and "--lora-rank" in out[0], out


_STATE = "the peak is about {}% parameters: no remat policy changes them; --lora-rank does"


@pytest.mark.parametrize(
    "rows, lines",
    [
        (
            [("full", [_STATE.format(74)]), ("none", []), ("selective", [_STATE.format(51)])],
            [
                "warning (full, selective): the peak is about 74/51% parameters: no remat policy changes them; "
                "--lora-rank does"
            ],
        ),
        (
            [("full", [_STATE.format(74)]), ("offload", [_STATE.format(74), "offload moves 8.4 MB nowhere"])],
            [f"warning (full, offload): {_STATE.format(74)}", "warning (offload): offload moves 8.4 MB nowhere"],
        ),
        ([("full", [_STATE.format(74)])], [f"warning (full): {_STATE.format(74)}"]),
        ([("none", []), ("full", [])], []),
    ],
    ids=["figures-differ", "same-text-and-a-lone-one", "one-row", "none"],
)
def test_a_warning_is_said_once_for_the_rows_it_applies_to(rows, lines):
    assert explain.warning_lines(rows) == lines


def test_a_comparison_says_a_shared_warning_once():
    _, args = M.make(policies.none(), batch=1, seq=1, d=64)
    make = lambda p: M.make(p, batch=1, seq=1, d=64)[0]
    table = remat_kit.compare(make, ["none", "full"], *args).table()
    shared = [line for line in table.splitlines() if "the peak is about" in line]
    assert len(shared) == 1 and shared[0].startswith("warning (none, full): "), table


@pytest.fixture(scope="module")
def tiny_none():
    """The tiny preset's step under none, without XLA's dump (as bench measures it)."""
    return analysis.analyze(TransformerConfig.preset("tiny"), "none", batch=2, seq=16)


def test_every_report_carries_the_state_warning_without_explain(tiny_none):
    # bench measures through analyze_compiled and inspect without the dump: the warning must be there anyway.
    a = tiny_none
    assert any("about" in w and "--lora-rank" in w for w in a.warnings), a.warnings
    loss, args = M.make(policies.none(), batch=1, seq=1, d=64)
    r = remat_kit.inspect(loss, *args)
    assert any("about" in w and "explain=True" in w and "--" not in w for w in r.warnings), r.warnings


def test_with_noop_warnings_names_a_policy_at_nones_peak_and_saved_set(tiny_none):
    import dataclasses

    a = tiny_none
    same = dataclasses.replace(a, policy="full")
    lower = dataclasses.replace(a, policy="selective", memory=dataclasses.replace(a.memory, temp=a.memory.temp - 1))
    out = analysis.with_noop_warnings({"none": a, "full": same, "selective": lower})
    assert [w for w in out["full"].warnings if "did nothing" in w] and "'full'" in out["full"].warnings[0]
    assert not any("did nothing" in w for n in ("none", "selective") for w in out[n].warnings)
    assert analysis.with_noop_warnings({"full": same}) == {"full": same}  # nothing to compare without none


# ---- the timeline's axis ------------------------------------------------------------------------------


def test_phases_line_up_across_policies_and_a_short_phase_stays_visible():
    # A long backward (full's recompute) and a short one, a 2-step loss and a 1-step optimizer.
    short = explain.Timeline((1,) * 40, ("forward",) * 20 + ("loss",) * 2 + ("backward",) * 17 + ("optimizer",), 0)
    long = explain.Timeline((1,) * 60, ("forward",) * 20 + ("loss",) * 2 + ("backward",) * 37 + ("optimizer",), 0)
    edges, (xs, xl) = explain.stage_axis([short, long])
    # The backward pass starts at the same x in both, though at step 22 of 40 and of 60.
    assert xs[22] == xl[22] == edges[3]
    assert xs[-1] >= edges[4] and xl[-1] >= edges[4]
    # The loss (2 of 60 steps) and the optimizer (1 step) each get at least the minimum width.
    assert edges[3] - edges[2] >= explain.MIN_STAGE_WIDTH - 1e-12 and 1 - edges[4] >= explain.MIN_STAGE_WIDTH - 1e-12


# ---- the offload guardrail end to end -----------------------------------------------------------------


def test_an_offload_to_a_destination_jax_ignores_is_named():
    # A user's own jax.checkpoint policy (no remat_kit label): JAX keeps 'unpinned_host' residuals on the device.
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["h"],
        offload_src="device",
        offload_dst="unpinned_host",
    )

    def loss(w, x):
        return jax.checkpoint(lambda w, x: jnp.sum(jnp.sin(checkpoint_name(jnp.tanh(x @ w), "h"))), policy=policy)(w, x)

    r = remat_kit.inspect(
        loss, jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((256, 64), jnp.float32)
    )
    [w] = [w for w in r.warnings if "offloads" in w]
    assert "nothing is saved to host memory" in w and "'pinned_host'" in w
