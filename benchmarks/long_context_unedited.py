"""The longest sequence a model the user installed trains at, unedited: ``remat_kit.max_seq`` on registry models.

tunix 0.1.7's Llama 3 at its own ``llama3p2_1b()`` config (16 layers x 2,048, vocabulary 128,256, tied), bf16
parameters, batch 1, clipped AdamW, XLA:CPU compile-only (nothing allocated), budgets with a 10 % margin. Rows:
the model as given with its plain loss; ``apply(model, "full", scan=True)`` with the plain loss; and every lever
``max_seq`` has here (its defaults). Beside each edge: the layer-input floor (16 x 2,048 x 2 B per position, what
``full`` must keep) and what is left above it. ``--family gemma`` runs gm.nn's Gemma 3 1B the same way.

``--real-step`` plans a small configuration of the same model on CPU and runs real steps at the planned longest
sequence in a fresh process (:func:`remat_kit.bench.run.run_bench` on this module's :func:`factory`), setting the
step's measured bytes beside the plan (within 10 %).

Usage::

    python benchmarks/long_context_unedited.py --rows plain,full,levers --budgets 16GB,24GB,80GB
    python benchmarks/long_context_unedited.py --real-step --budget 200MB
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from remat_kit.planning import max_seq as max_seq_lib
from remat_kit.units import fmt_bytes, parse_bytes

#: The rows: (label, max_seq keyword arguments). ``levers``: max_seq's defaults, every lever it has here.
ROWS = {
    "plain": (
        "model as given, plain loss",
        dict(policy="none", scan=False, query_blocks=1, seq_tiles=1, loss_chunks=0),
    ),
    "full": ('apply(model, "full", scan=True), plain loss', dict(query_blocks=1, seq_tiles=1, loss_chunks=0)),
    "blocks": ("query blocks and tiles (auto), plain loss", dict(loss_chunks=0)),
    "levers": ("every lever (max_seq's defaults), the loss through remat_kit.head_loss", {}),
}


def _bf16(make):
    """An abstract NNX model (``nnx.eval_shape``: nothing allocated) with bfloat16 parameters."""

    def build():
        model = make()
        state = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
        return model

    return nnx.eval_shape(build)


def llama(small: bool = False):
    """tunix's Llama 3 at ``llama3p2_1b()`` (or, ``small``, the same code at 2 x 256, vocabulary 2,048)."""
    from tunix.models.llama3 import model as m

    config = m.ModelConfig.llama3p2_1b()
    if small:
        config = dataclasses.replace(
            config,
            num_layers=2,
            vocab_size=2048,
            embed_dim=256,
            hidden_dim=1024,
            num_heads=4,
            head_dim=64,
            num_kv_heads=2,
        )
    return config, (lambda: m.Llama3(config, rngs=nnx.Rngs(0)))


def loss(model, tokens, positions, mask):
    """Next-token cross-entropy on the model's full logits (what a user writes first), in float32."""
    logits, _ = model(tokens, positions, None, mask)
    logits = logits[:, :-1].astype(jnp.float32)
    picked = jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def head_loss(model, tokens, positions, mask, *, loss_chunks):
    """The same loss with the head in chunks (:func:`remat_kit.head_loss`; 0: :func:`loss`, whole logits)."""
    import remat_kit

    if loss_chunks == 0:
        return loss(model, tokens, positions, mask)
    labels = jnp.roll(tokens, -1, axis=1)  # the next token; the last position does not count
    counts = jnp.broadcast_to(jnp.arange(tokens.shape[1]) < tokens.shape[1] - 1, tokens.shape).astype(jnp.float32)
    return remat_kit.head_loss(
        model, tokens, positions, None, mask, labels=labels, mask=counts, chunks=loss_chunks, head="embedder.decode"
    )


def args_at(seq: int, batch: int = 1) -> tuple:
    """tokens, positions, a causal mask: ``[batch, seq]``, ``[batch, seq]``, ``[batch, seq, seq]`` (shapes only)."""
    return (
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        jax.ShapeDtypeStruct((batch, seq, seq), jnp.bool_),
    )


def gemma():
    """gm.nn's Gemma 3 1B (26 x 1,152, vocabulary 262,144; Linen): ``(model, loss, args_at)``, bf16 variables."""
    from gemma import gm

    model = gm.nn.Gemma3_1B(dtype=jnp.bfloat16)
    tokens = jnp.ones((1, 8), jnp.int32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
    variables = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), variables)

    def gemma_loss(m, v, tokens):
        logits = m.apply(v, tokens).logits[:, :-1].astype(jnp.float32)
        picked = jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    def gemma_head_loss(m, v, tokens, *, loss_chunks):
        import remat_kit

        if loss_chunks == 0:
            return gemma_loss(m, v, tokens)
        labels = jnp.roll(tokens, -1, axis=1)
        counts = jnp.broadcast_to(jnp.arange(tokens.shape[1]) < tokens.shape[1] - 1, tokens.shape).astype(jnp.float32)
        return remat_kit.head_loss(m, v, tokens, labels=labels, mask=counts, chunks=loss_chunks, head="embedder.decode")

    at = lambda seq: (variables, jax.ShapeDtypeStruct((1, seq), jnp.int32))
    return model, (gemma_loss, gemma_head_loss), at


def factory(policy):
    """``MODULE:FACTORY`` for ``run_bench``: the small Llama under the levers at ``$LONG_CONTEXT_SEQ`` (full, scan)."""
    import remat_kit

    seq = int(os.environ["LONG_CONTEXT_SEQ"])
    levers = os.environ.get("LONG_CONTEXT_LEVERS") == "1"
    _, make = llama(small=True)
    model = _bf16(make)
    if levers:  # max_seq's defaults: query blocks, tiles, the loss at the head in chunks
        chunked = functools.partial(head_loss, loss_chunks="auto")
        kw = dict(query_blocks="auto", seq_tiles="auto")
        make_loss = remat_kit.apply_factory(model, chunked, scan=str(policy) != "none", **kw)
    else:
        make_loss = remat_kit.apply_factory(model, loss, scan=str(policy) != "none")
    tokens = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32) % 2048, (1, seq))
    mask = jnp.tril(jnp.ones((seq, seq), bool))[None]
    return make_loss(policy), (nnx.state(model, nnx.Param), tokens, tokens, mask)


def _header(args) -> None:
    load = os.getloadavg()
    print(f"$ python {' '.join(sys.argv)}")
    print(
        f"jax {jax.__version__}, {platform.python_version()}, {jax.devices()[0].platform}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start (2 cores, shared), "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    )


def _fixed_of(params) -> int:
    """Parameters, gradients and AdamW's state of a Linen model's variables (from shapes)."""
    from remat_kit.planning.planner import get_optimizer
    from remat_kit.step import update

    params, opt_state = update.abstract_state(params, get_optimizer("adamw"))
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    return 2 * size(params) + size(opt_state)


def _fixed_bytes(model) -> int:
    """What no sequence length changes: the parameters, their gradients and AdamW's state (from shapes)."""
    return _fixed_of(nnx.state(model, nnx.Param))


def plan_rows(args) -> None:
    _header(args)
    if args.family == "tunix":
        config, make = llama()
        layers, width = config.num_layers, config.embed_dim
        what = "tunix Llama 3 llama3p2_1b()"
        model, losses, at = _bf16(make), {"levers": head_loss}, args_at
    else:
        model, (plain_loss, chunked), at = gemma()
        layers, width, what = 26, 1152, "gemma gm.nn Gemma3_1B"
        losses = {"levers": chunked}
    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    fixed = _fixed_bytes(model) if args.family == "tunix" else _fixed_of(at(args.step)[0])
    floor = max_seq_lib.layer_input_floor(layers, width, 2)
    print(
        f"{what}: {layers} x {width}, bf16 parameters, batch 1, clipped AdamW, XLA:CPU compile-only, margin "
        f"{args.margin:.0%}; lengths in multiples of {args.step}; floor: the layer inputs, {fmt_bytes(floor)} per "
        f"position; fixed: parameters, AdamW state and gradients, {fmt_bytes(fixed)}\n"
    )
    for key in args.rows.split(","):
        label, kwargs = ROWS[key]
        t = time.perf_counter()
        search = max_seq_lib.prepare(
            model,
            losses.get(key, loss if args.family == "tunix" else plain_loss),
            at,
            step=args.step,
            limit=args.limit,
            start=args.start,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            **kwargs,
        )
        print(f"{label}: {search.levers.describe()}")
        for u in search.unavailable:
            print(f"  not used: {u}")
        for b in budgets:
            r = search.edge(b, args.margin)
            line = f"  {fmt_bytes(b):>8}: longest {r.seq:>7,}"
            if r.seq:
                line += f" needs {fmt_bytes(r.need_bytes * (1 + r.margin))}"
            if r.next_seq is not None:
                line += f"; {r.next_seq:,} needs {fmt_bytes(r.next_need_bytes * (1 + r.margin))}, over"
            if r.seq:
                per = (r.need_bytes - fixed) / r.seq
                line += (
                    f"; {fmt_bytes(per)} per position above the fixed part = {per / floor:.1f}x the floor, "
                    f"{fmt_bytes(r.need_bytes - fixed - floor * r.seq)} above it"
                )
            print(line, flush=True)
        print(f"  {search.planner.compiles} compiles, {time.perf_counter() - t:.0f} s")
        print("  needs: " + ", ".join(f"{s:,}: {fmt_bytes(v)}" for s, v in r.needs), flush=True)


def real_step(args) -> None:
    """Plan the small Llama (full, scan) at ``--budget``, then run real steps at the planned length."""
    from remat_kit.bench.run import run_bench
    from remat_kit.model.transformer import TransformerConfig

    _header(args)
    _, make = llama(small=True)
    model = _bf16(make)
    budget = parse_bytes(args.budget)
    levers = {} if args.levers else dict(query_blocks=1, seq_tiles=1, loss_chunks=0)
    r = max_seq_lib.max_seq(
        model,
        head_loss if args.levers else loss,
        args_at,
        budget=budget,
        step=args.step,
        limit=args.limit,
        margin=args.margin,
        **levers,
    )
    print(f"small Llama 3 (2 x 256, vocabulary 2,048), bf16 parameters, batch 1; plan: {r.summary()}")
    os.environ["LONG_CONTEXT_SEQ"] = str(r.seq)
    os.environ["LONG_CONTEXT_LEVERS"] = "1" if args.levers else "0"
    records = run_bench(
        TransformerConfig.preset("tiny"),
        1,
        r.seq,
        ["full"],
        steps=args.steps,
        warmup=1,
        grad_check=False,
        subprocesses=True,
        model=f"{__name__ if __name__ != '__main__' else 'long_context_unedited'}:factory",
    )
    record = next(x for x in records if x.policy == "full")
    print(
        f"real steps at {r.seq:,}: compiled need there {fmt_bytes(record.xla_peak_bytes)} (plan: "
        f"{fmt_bytes(r.need_bytes)}); peak RSS {fmt_bytes(record.peak_bytes)}, baseline before the first step "
        f"(runtime, code, parameters, optimizer state) {fmt_bytes(record.baseline_bytes)}"
    )
    state = _fixed_bytes(model) - sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    used = record.peak_bytes - record.baseline_bytes + state
    close = "yes" if abs(used / r.need_bytes - 1) <= 0.1 else "no"
    print(
        f"the step's peak above the baseline plus the state ({fmt_bytes(state)}): {fmt_bytes(used)} = "
        f"{used / r.need_bytes:.2f}x the plan's need; within 10 %: {close}; "
        f"median step {record.step_time_s:.2f} s"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="tunix", choices=("tunix", "gemma"))
    ap.add_argument("--rows", default="plain,full,levers")
    ap.add_argument("--budgets", default="16GB,24GB,80GB")
    ap.add_argument("--margin", type=float, default=0.1)
    ap.add_argument("--step", type=int, default=256)
    ap.add_argument("--start", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=131072)
    ap.add_argument("--real-step", action="store_true")
    ap.add_argument("--budget", default="200MB", help="with --real-step")
    ap.add_argument("--levers", action="store_true", help="with --real-step: every lever (max_seq's defaults)")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    with jax.numpy_rank_promotion("allow"):  # tunix broadcasts ranks implicitly
        real_step(args) if args.real_step else plan_rows(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
