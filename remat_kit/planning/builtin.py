"""Planning the built-in Transformer: its planner, its candidates, and auto and max_fit of a config.

The generic engine (:mod:`remat_kit.planning.planner`, :mod:`remat_kit.planning.budget`,
:mod:`remat_kit.planning.engine`) plans any loss and imports no model; this module is the built-in model's side of
it (its per-tensor choice, and ``fit`` of a ``Transformer``, are :mod:`remat_kit.planning.tensors`'), imported by
the entry (:mod:`remat_kit.planning.fit`) above both.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from remat_kit import policies
from remat_kit.analysis import memory
from remat_kit.model.loss import lm_loss, resolve_chunks
from remat_kit.model.transformer import Transformer, TransformerConfig
from remat_kit.planning import analysis, cost
from remat_kit.planning import tiles as tiles_lib
from remat_kit.planning.budget import AutoResult, search, why_chosen
from remat_kit.planning.limits import boundary
from remat_kit.planning.planner import DEFAULT_MARGIN, Budget, StepPlanner
from remat_kit.step import mesh as mesh_lib
from remat_kit.step import update as step_lib


class Planner(StepPlanner):
    """A :class:`StepPlanner` for :class:`remat_kit.model.transformer.Transformer` steps of one config.

    Args:
      config: the model.
      optimizer: a name in :data:`OPTIMIZERS` or an optax transformation.
      loss_chunks: 0 for the plain loss, k for the chunked loss, ``"auto"`` for the count ``train`` picks at
        each shape (:func:`remat_kit.model.loss.auto_chunks`: it grows with the sequence).
      mesh: a ``jax.sharding.Mesh`` or a mesh spec such as ``"data=2,fsdp=2"``; bytes are then per device.
      grad_accum: micro-batches per update: ``optax.MultiSteps`` adds its gradient buffer, as in ``train``.
      progress: see :class:`StepPlanner`.
      target: the device planned for (:func:`remat_kit.target.parse`); see :class:`StepPlanner`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        optimizer: str | optax.GradientTransformation = "adamw",
        loss_chunks: int = 0,
        mesh=None,
        grad_accum: int = 1,
        progress: Callable | None = None,
        target=None,
    ):
        self.config = config
        self.loss_chunks = loss_chunks
        params = analysis.abstract_params(config)

        def build(policy, batch, seq):
            chunks = self.chunks_at(batch, seq)
            analysis.check_shape(config, batch, seq, chunks)
            if self.mesh is not None:
                mesh_lib.check_batch(batch, self.mesh)
            model = Transformer(config=config, policy=policy)
            loss = lambda p, tokens: lm_loss(model, p, tokens, loss_chunks=chunks)
            return loss, params, (jax.ShapeDtypeStruct((batch, seq), jnp.int32),)

        super().__init__(build, optimizer, mesh, progress, target=target)
        self._params = params
        if grad_accum > 1:
            self.opt = optax.MultiSteps(self.opt, every_k_schedule=grad_accum)

    def chunks_at(self, batch: int, seq: int) -> int:
        """The loss's chunk count at a shape: ``loss_chunks`` itself, or (``"auto"``) what ``train`` picks there."""
        if self.loss_chunks == "auto":
            devices = 1 if self.mesh is None else self.mesh.size
            return resolve_chunks("auto", batch * seq, self.config.vocab_size, devices)
        return self.loss_chunks

    def state_bytes(self) -> int:
        """Bytes of the parameters and optimizer state on each device, from shapes alone (nothing compiled).

        Every policy's step holds at least these, so a budget below them fits none.
        """
        state = step_lib.abstract_state(self._params, self.opt)
        leaves = jax.tree.leaves(state)
        if self.mesh is None:
            shapes = [leaf.shape for leaf in leaves]
        else:
            shardings = jax.tree.leaves(mesh_lib.tree_shardings(state, self.mesh))
            shapes = [s.shard_shape(leaf.shape) for leaf, s in zip(leaves, shardings, strict=True)]
        return sum(math.prod(shape) * leaf.dtype.itemsize for shape, leaf in zip(shapes, leaves, strict=True))


def candidates_for(config: TransformerConfig, *, offload: bool | None = None) -> tuple[policies.Policy, ...]:
    """The policies :func:`remat_kit.planning.fit.auto` considers for ``config``, without duplicates.

    ``none``; the selective presets and subsets of the matmul outputs; ``dots``; ``every_n(n)`` for
    n in 2, 3, 4, 8 (at most the depth); ``segments(k)`` for k in 2, 4 and ``sqrt_n``; ``full``; and,
    where the backend has a host memory kind (or ``offload=True``), the offload variants.
    """
    L = config.num_layers
    out = [
        policies.none(),
        policies.selective(),
        policies.parse("minimal"),
        policies.parse("save_dot_except_mlp"),
        policies.parse("save_dot_with_context_except_mlp"),
        policies.parse("save_dot_except_mlpwi"),
        policies.selective(["q_proj", "k_proj", "v_proj", "context"]),
        policies.parse("save_qkv_proj"),
        policies.selective(["mlp_gate", "mlp_up"]),
        policies.dots(),
        *(policies.every_n(n) for n in (2, 3, 4, 8) if n <= L),
        *(policies.segments(k) for k in (2, 4) if k < L and k != policies.sqrt_n_group_size(L)),
        policies.sqrt_n(),
        policies.full(),
    ]
    if memory.host_offload().available if offload is None else offload:
        out += [policies.offload(), policies.parse("qkv_proj_offloaded"), policies.parse("minimal_offloaded")]
    return tuple(dict.fromkeys(out))


def auto_config(
    config: TransformerConfig,
    args: tuple,
    budget: Budget,
    *,
    candidates=None,
    optimizer: str | optax.GradientTransformation = "adamw",
    planner: StepPlanner | None = None,
    batch: int | None = None,
    seq: int | None = None,
    loss_chunks: int = 0,
    exhaustive: bool = False,
    jobs: int = 1,
    hardware: cost.Hardware | None = None,
    mixes: bool = True,
    tiles: Sequence[int] | None = None,
    target=None,
) -> AutoResult:
    """:func:`remat_kit.planning.fit.auto` of the built-in Transformer (``auto(config, batch=, seq=, ...)``), its
    arguments checked before anything is compiled: the candidates of :func:`candidates_for` (or ``candidates``)
    searched untiled, then, when nothing fits and ``config.seq_tiles`` is 1, in sequence tiles
    (:func:`search_tiled`)."""
    if args:
        raise TypeError("auto(config, ...) takes batch= and seq= keywords, not positional inputs")
    if batch is None or seq is None:
        raise TypeError("auto(config, ...) needs batch= and seq=")
    analysis.check_shape(config, batch, seq, loss_chunks)
    counts = tiles_lib.check_counts(tiles, batch, seq) if config.seq_tiles == 1 else ()
    planner = planner or Planner(config, optimizer, loss_chunks, target=target)
    offload = True if planner.target.compile_only else None  # a GPU target's offload candidates count
    pool = [
        policies.parse(p, num_layers=config.num_layers) for p in (candidates or candidates_for(config, offload=offload))
    ]
    kw = {"exhaustive": exhaustive, "batch": batch, "seq": seq, "loss_chunks": loss_chunks, "jobs": jobs}
    result = search(planner, pool, budget, hardware=hardware, num_layers=config.num_layers if mixes else None, **kw)
    if result.chosen is None and counts:
        result = search_tiled(result, config, planner, pool, budget, counts, mixes=mixes, **kw)
    return result


def search_tiled(
    untiled: AutoResult,
    config: TransformerConfig,
    planner: Planner,
    pool: Sequence[policies.Policy],
    budget: Budget,
    counts: Sequence[int],
    *,
    mixes: bool,
    batch: int,
    seq: int,
    loss_chunks: int,
    **kw,
) -> AutoResult:
    """:func:`remat_kit.planning.fit.auto`'s tile lever, when nothing fits untiled: :func:`search` again with
    the blocks in each of ``counts`` sequence tiles (most first, until a count where nothing fits: fewer tiles hold
    more), every tiled candidate priced over the untiled ``none`` (:func:`remat_kit.planning.tiles.tiles_cost_s`);
    the fitting (tiles, policy) with the least estimated cost wins."""
    start = time.perf_counter()
    layers = config.num_layers if mixes else None

    def at(k: int) -> AutoResult:
        tiled = retiled(planner, dataclasses.replace(config, seq_tiles=k))
        r = search(tiled, pool, budget, hardware=untiled.hardware, num_layers=layers, batch=batch, seq=seq, **kw)
        over = tiles_lib.tiles_cost_s(planner, tiled, batch, seq, untiled.hardware)
        return dataclasses.replace(r, candidates=tiles_lib.priced_tiled(r.candidates, k, over), seq_tiles=k)

    key = lambda r: min((c.rank, c.need_bytes) for c in r.candidates if r.is_chosen(c))
    swept, best = tiles_lib.sweep(counts, at, key)
    tried = [untiled, *swept]
    shown = ", ".join(str(t.seq_tiles) for t in tried[1:])
    combined = {
        "candidates": tuple(c for t in tried for c in t.candidates),
        "compiled": sum(t.compiled for t in tried),
        "seconds": untiled.seconds + time.perf_counter() - start,
        "notes": tuple(dict.fromkeys(n for t in tried for n in t.notes)),
    }
    if best is None:
        return dataclasses.replace(untiled, reason=f"{untiled.reason} Nor in {shown} sequence tiles.", **combined)
    why = why_chosen(best.chosen, best.candidates, budget, loss_chunks)
    reason = (
        f"Nothing fits untiled; in {best.seq_tiles} sequence tiles (the cheapest that fits of {shown} tried): {why}"
    )
    return dataclasses.replace(best, reason=reason, **combined)


def retiled(planner: StepPlanner, config: TransformerConfig) -> Planner:
    """A :class:`Planner` of ``config`` that plans what ``planner`` (a Planner of the
    same model untiled) plans: its optimizer (gradient accumulation included), loss chunks, mesh and progress."""
    if not isinstance(planner, Planner):
        raise TypeError(
            f"sequence tiles re-plan the step with a Planner of the built-in model, got a {type(planner).__name__}; "
            "pass tiles=() to plan untiled"
        )
    new = Planner(
        config,
        loss_chunks=planner.loss_chunks,
        mesh=planner.mesh,
        progress=planner.progress,
        target=planner.target,
    )
    new.opt, new.optimizer_name = planner.opt, planner.optimizer_name
    return new


def max_fit(
    config: TransformerConfig,
    policy: policies.Policy | str,
    *,
    dim: str,
    batch: int,
    seq: int,
    budget_bytes: int,
    margin: float = DEFAULT_MARGIN,
    planner: Planner | None = None,
    optimizer: str | optax.GradientTransformation = "adamw",
    loss_chunks: int = 0,
    limit: int | None = None,
) -> int:
    """The largest batch (``dim="batch"``, at fixed ``seq``) or the longest sequence (``dim="seq"``,
    at fixed ``batch``) whose step fits the budget under ``policy``; 0 if even 1 does not fit.

    Exact: the answer fits and the answer + 1 does not, both by real compile (or the answer is the
    limit: the model's ``max_seq_len`` for ``seq``, ``limit`` or 2**20 for ``batch``). Compile-only,
    and few compiles: the step's bytes are affine in the batch (a quadratic at most in the sequence,
    through attention), so two compiles give the line, the line names the answer and two more confirm
    it (:func:`boundary`); a sequence limit that fits is checked first (one compile).
    """
    if dim not in ("batch", "seq"):
        raise ValueError(f"dim must be 'batch' or 'seq', got {dim!r}")
    budget = Budget(budget_bytes, margin)
    policy = policies.parse(policy)
    planner = planner or Planner(config, optimizer, loss_chunks)
    cap = limit or (config.max_seq_len if dim == "seq" else 2**20)
    need = lambda n: planner.memory(policy, *((n, seq) if dim == "batch" else (batch, n)))[0]
    target = budget.target
    first = 1
    if isinstance(planner.loss_chunks, int) and planner.loss_chunks:  # chunks may not exceed the token count
        first = -(-planner.loss_chunks // (seq if dim == "batch" else batch))
    start = max(first, min(batch if dim == "batch" else seq, cap))
    if dim == "seq":
        if need(cap) <= target:
            return cap
        # The parabola through the given length, twice it and the limit names the answer.
        return boundary(need, target, first, cap, probes=(start, 2 * start), degree=2, known={cap: need(cap)})
    # Bytes at batch 1 may not lie on the line (XLA's layout differs there): the line starts at 2 or more.
    p0 = max(start, 2 * first, 2) if cap >= 2 else start
    return boundary(need, target, first, cap, probes=(p0, 2 * p0), degree=1)
