"""The fenced XLA dump reader (remat_kit/_xla_dump.py) on tiny jitted functions with known buffers.

Runs on every JAX CI runs (jax 0.10.x and the newest): a change in XLA's dump files breaks here, loudly.
"""

import jax
import jax.numpy as jnp
import pytest

from remat_kit.analysis import _xla_dump
from remat_kit.analysis.memory import CompiledMemory

F32 = 4
W, X = jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((8, 64), jnp.float32)


def sin_loss(w, x):
    return jnp.sum(jnp.sin(x @ w))  # the backward pass keeps cos(x @ w): f32[8, 32]


@pytest.fixture(scope="module")
def sin_program():
    compiled, program = _xla_dump.compile_with_dump(jax.jit(jax.value_and_grad(sin_loss)).lower(W, X))
    return CompiledMemory.from_compiled(compiled), program


def _layer(h, w):
    return jnp.tanh(h @ w), None


def scan_loss(ws, x):
    h, _ = jax.lax.scan(jax.checkpoint(_layer), x, ws)
    return jnp.sum(h**2)


TRIPS = 4
WS = jax.ShapeDtypeStruct((TRIPS, 64, 64), jnp.float32)


@pytest.fixture(scope="module")
def scan_program():
    compiled, program = _xla_dump.compile_with_dump(jax.jit(jax.value_and_grad(scan_loss)).lower(WS, X))
    return CompiledMemory.from_compiled(compiled), program


def test_parameters_are_buffers_of_their_own_size(sin_program):
    _, p = sin_program
    params = {b.parameter: b for b in p.buffers if b.kind == "parameter"}
    assert (params[0].shape, params[0].dtype, params[0].nbytes) == ((64, 32), "f32", 64 * 32 * F32)
    assert (params[1].shape, params[1].nbytes) == ((8, 64), 8 * 64 * F32)
    # Parameters are live from the start to the end of the program.
    assert params[0].start == 0 and params[0].end >= len(p.sequence) - 1


def test_the_saved_cosine_is_a_forward_buffer_read_by_the_backward_pass(sin_program):
    _, p = sin_program
    ins = {i.name: i for i in p.sequence}
    cos = [b for b in p.buffers if "jvp()/cos" in ins.get(b.instruction, ins[p.sequence[0].name]).op_name]
    assert [(b.shape, b.nbytes) for b in cos] == [((8, 32), 8 * 32 * F32)]
    users = [i for i in p.sequence[cos[0].start + 1 : cos[0].end + 1] if "transpose(" in i.op_name]
    assert users, "the cosine lives until the weight gradient's matmul reads it"
    assert ins[cos[0].instruction].source.startswith("test_xla_dump.py:"), ins[cos[0].instruction].source


def test_live_bytes_never_exceed_the_compiled_memory(sin_program, scan_program):
    for held, p in (sin_program, scan_program):
        live = p.live_bytes()
        # XLA's allocations hold at least what is live at any instruction; only small tuple tables are left over.
        assert max(live) <= held.total
        assert held.total - max(live) <= 0.02 * held.total, (held.total, max(live))


def test_a_scan_body_is_found_with_its_trip_count(scan_program):
    _, p = scan_program
    assert sorted({trips for _, trips in p.trips.values()}) == [TRIPS]
    in_loop = [t for t in range(len(p.sequence)) if p.loops(t)]
    assert in_loop, "the while bodies' instructions sit in the flattened sequence"
    # Each body is repeated once per trip in the executed order.
    assert len(p.expanded()) == len(p.sequence) + (TRIPS - 1) * len(in_loop)


def test_host_colour_and_counted_kinds_are_stated():
    assert _xla_dump.HOST_COLOR == 5
    assert set(_xla_dump.COUNTED_KINDS) == {"parameter", "output", "temp"}


def test_a_missing_or_changed_dump_fails_loudly(tmp_path):
    with pytest.raises(_xla_dump.DumpFormatError, match="wrote no"):
        _xla_dump.read_dump(str(tmp_path))
    with pytest.raises(_xla_dump.DumpFormatError, match="live-range format changed"):
        _xla_dump.parse_live_ranges("HloLiveRange (max 3):\n  something else\n")
    with pytest.raises(_xla_dump.DumpFormatError, match="buffer assignment"):
        _xla_dump.parse_buffer_assignment("BufferAssignment:\nnothing here\n")
    with pytest.raises(_xla_dump.DumpFormatError, match="HLO"):
        _xla_dump.parse_hlo("HloModule m\n")


def test_a_moved_value_is_followed_back_to_the_value_it_reads():
    # bfloat16 layers in a scan: XLA copies and converts the loop's tuple elements (jax 0.10's XLA:CPU converts
    # the stacked bfloat16 outputs of the forward loop to float32 whole).
    def loss(ws, x):
        return jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].astype(jnp.float32) ** 2)

    args = (jax.ShapeDtypeStruct((TRIPS, 64, 64), jnp.bfloat16), jax.ShapeDtypeStruct((32, 64), jnp.bfloat16))
    _, p = _xla_dump.compile_with_dump(jax.jit(jax.value_and_grad(loss)).lower(*args))
    for i in p.sequence:  # every instruction records what it reads and its result type
        assert all(isinstance(o, str) and o for o in i.operands), i
        assert i.dtype in _xla_dump._DTYPE_BYTES or i.dtype == "", i
    computing = [i for i in p.sequence if i.opcode in ("dot", "tanh", "multiply") and not i.moves]
    assert computing and all(p.origin(i.name) is None for i in computing)
    origins = [(i, p.origin(i.name)) for i in p.sequence if i.moves]
    assert origins and all(o is None or o.moves for _, o in origins)
    buffers = {b.name: b for b in p.buffers}
    for i, o in origins:
        if o is not None and o.value in buffers:
            assert (buffers[o.value].dtype, buffers[o.value].nbytes) == (o.dtype, o.nbytes), o
        if o is not None and "convert" in o.moves and set(o.moves) == {"convert"}:
            assert o.dtype != i.dtype, (i, o)  # a convert changes the dtype
    # A read of a tuple element names it as the buffer assignment does ("while.3{2}"), through a
    # get-tuple-element (jax 0.10) or the ``x#2`` operand jax 0.12 prints instead.
    elements = [o for _, o in origins if o and "{" in o.value]
    assert elements, origins
    assert all(p.instructions[o.instruction].opcode in ("while", "parameter", "tuple", "fusion") for o in elements)
    # The loop's stacked output and the body parameter's elements are its outputs (what the body fills in place).
    loop = next(name for name, _ in p.trips.values())
    outputs = [b.name for b in p.buffers if b.name.startswith(loop + "{")]
    carried = {p.carried(b.name) for b in p.buffers} - {None}
    assert carried and carried <= {f"{w}{{{k}}}" for w, _ in p.trips.values() for k in range(64)}
    assert any(c in outputs for c in carried), (carried, outputs)
    # XLA gives the fusions it makes no metadata; the op at a fused computation's root (through casts and copies)
    # carries JAX's op_name and source line.
    fusions = [i for i in p.instructions.values() if i.opcode == "fusion"]
    computations = {i.computation for i in p.instructions.values()}
    assert fusions and all(i.calls in computations for i in fusions), fusions
    named = [(i, p.annotated(i.name)) for i in fusions if not i.op_name]
    assert any(a is not None for _, a in named), named
    for i, a in named:
        assert a is None or (a.op_name.startswith("jit(") and a.source), (i, a)
