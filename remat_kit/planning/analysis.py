"""What a training step under a policy keeps, needs and costs: compile-only, nothing allocated.

Tracing the step, labelling residuals with the block's tags, the memory and FLOP figures and the
textbook estimates (:mod:`remat_kit.planning.estimates`) all fill one :class:`Analysis` record.

:func:`analyze` traces one AdamW training step of :class:`remat_kit.model.transformer.Transformer` from
``jax.ShapeDtypeStruct`` inputs (``jax.eval_shape`` for the parameters), compiles it, and reports:

* the saved residuals, read from JAX's own residual analysis
  (:func:`remat_kit._jax_internals.saved_residuals`), each labelled with the block's
  ``checkpoint_name`` tag where one fits, and split into the layer stack and the head (embedding,
  final norm, loss);
* XLA's compiled memory (``Compiled.memory_analysis()``);
* matmul FLOPs counted from the jaxpr with scan bodies multiplied by their trip count
  (:mod:`remat_kit.analysis.flops`), beside XLA's raw ``cost_analysis()`` figure, which counts a scan once;
* the seed's analytic estimates (Korthikanti et al. 2022; layer inputs; logits) for comparison.

>>> a = analyze(TransformerConfig.preset("tiny"), "full", batch=2, seq=32)
>>> a.layers_saved_bytes == 4 * 2 * 32 * 64 * 4  # L · b · s · d · float32: only the layer inputs
True
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
import time
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from remat_kit import _jax_internals, policies
from remat_kit import target as target_lib
from remat_kit.analysis import _xla_dump, flops, inspection
from remat_kit.analysis import explain as explain_lib
from remat_kit.analysis.memory import CompiledMemory, host_offload, tree_bytes
from remat_kit.model import lora
from remat_kit.model.loss import lm_loss
from remat_kit.model.transformer import Block, Transformer, TransformerConfig, abstract_params, resolve_tiles
from remat_kit.planning import estimates as estimates_lib
from remat_kit.planning.planner import cancel_on_error, target_mesh
from remat_kit.step import mesh as mesh_lib
from remat_kit.step import update as step_lib
from remat_kit.units import check_int

#: Regions of the step a residual belongs to.
REGIONS: tuple[str, ...] = ("layers", "head")


@dataclasses.dataclass(frozen=True)
class SavedResidual:
    """One tensor the backward pass keeps.

    Attributes:
      region: ``"layers"`` (the scanned block stack) or ``"head"`` (embedding, final norm, loss).
      label: what it is: a tag (``"q_proj"``), candidate tags (``"attn_norm|mlp_norm"``), a weight
        slice (``"weight layers.mlp_up.kernel"``) or JAX's short description (``"exp in xla_attention"``).
      tags: the ``checkpoint_name`` tags it may be (several when only shape and dtype tell them apart).
      shape: its shape; stacked residuals of the layer scan carry the layer (or group) axis first.
      dtype: dtype name.
      nbytes: size in bytes.
      host: True when it lives in host memory (offloaded).
      source: JAX's description of where it comes from.
    """

    region: str
    label: str
    tags: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    host: bool
    source: str


@dataclasses.dataclass(frozen=True)
class Analysis(inspection.StepRecord):
    """The compile-only measurement of one training step under one policy: the generic record of a step
    (:class:`remat_kit.analysis.inspection.StepRecord`: ``policy``, ``notes``, ``warnings`` and, with
    ``explain=True``, what is live at the peak) plus the built-in model's figures.

    Attributes:
      config: the model configuration.
      batch, seq: the token shape; loss_chunks: 0 for the plain loss, k for the chunked one.
      residuals: every non-argument tensor the backward pass keeps, largest first.
      saved_bytes, saved_host_bytes: their totals on the device and in host memory (offloaded
        bytes count as device bytes where offload is not enforced, as on CPU).
      layers_saved_bytes, layers_saved_host_bytes: the same for the layer stack alone.
      param_bytes: bytes of the parameters (arguments, not activation memory).
      memory: XLA's compiled memory.
      flops: matmul FLOPs per step counted from the jaxpr (scan trip counts applied).
      xla_flops: XLA's raw ``cost_analysis()["flops"]`` (a scan body counted once; see :mod:`remat_kit.analysis.flops`).
      analytic: textbook FLOPs for ``none`` and for one extra forward of the layers.
      estimates: the seed's analytic byte figures.
      compile_s: seconds to lower and compile the step.
      mesh: the mesh spec the step was compiled for (None: one device); ``memory`` is then per device.
      batch_devices: devices the batch is split over (``data`` × ``fsdp``).
    """

    config: TransformerConfig
    batch: int
    seq: int
    loss_chunks: int
    residuals: tuple[SavedResidual, ...]
    saved_bytes: int
    saved_host_bytes: int
    layers_saved_bytes: int
    layers_saved_host_bytes: int
    param_bytes: int
    memory: CompiledMemory
    flops: int
    xla_flops: float
    analytic: estimates_lib.AnalyticFlops
    estimates: estimates_lib.Estimates
    compile_s: float
    mesh: str | None = None
    batch_devices: int = 1

    made_by: ClassVar[tuple[str, str]] = ("analysis", "analyze")

    @property
    def peak_bytes(self) -> int:
        """The compiled step's device bytes at its peak: arguments + outputs − aliased + temp."""
        return self.memory.total

    @property
    def saved_bytes_per_device(self) -> int:
        """Device-resident saved bytes on each device: the batch (and so every activation) is split
        over ``batch_devices``."""
        return self.saved_bytes // self.batch_devices

    def largest(self, n: int = 5, region: str | None = None) -> tuple[SavedResidual, ...]:
        """The ``n`` largest residuals (of ``region`` if given): what to target next."""
        rows = [r for r in self.residuals if region is None or r.region == region]
        return tuple(rows[:n])

    def by_label(self, region: str | None = None) -> dict[str, int]:
        """Saved bytes grouped by label (of ``region`` if given), largest first."""
        totals: collections.Counter[str] = collections.Counter()
        for r in self.residuals:
            if region is None or r.region == region:
                totals[r.label] += r.nbytes
        return dict(totals.most_common())

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        """A JSON-ready record (``top`` limits the residual list; None keeps all)."""
        residuals = self.residuals if top is None else self.residuals[:top]
        return {
            "policy": self.policy,
            "config": dataclasses.asdict(self.config),
            "batch": self.batch,
            "seq": self.seq,
            "loss_chunks": self.loss_chunks,
            "saved_bytes": self.saved_bytes,
            "saved_host_bytes": self.saved_host_bytes,
            "layers_saved_bytes": self.layers_saved_bytes,
            "layers_saved_host_bytes": self.layers_saved_host_bytes,
            "head_saved_bytes": self.saved_bytes - self.layers_saved_bytes,
            "param_bytes": self.param_bytes,
            "argument_bytes": self.memory.argument,
            "output_bytes": self.memory.output,
            "alias_bytes": self.memory.alias,
            "temp_bytes": self.memory.temp,
            "peak_bytes": self.peak_bytes,
            "host_bytes": self.memory.host_argument + self.memory.host_output + self.memory.host_temp,
            "host_temp_bytes": self.memory.host_temp,
            "flops": self.flops,
            "xla_flops_raw": self.xla_flops,
            "analytic_flops_none": self.analytic.none,
            "analytic_flops_full": self.analytic.full,
            "estimates": dataclasses.asdict(self.estimates),
            "compile_s": self.compile_s,
            "mesh": self.mesh,
            "saved_bytes_per_device": self.saved_bytes_per_device,
            "notes": list(self.notes),
            "at_peak": dict(self.at_peak),
            "host_at_peak": self.host_at_peak,
            "peak_at": self.peak_at,
            "largest_at_peak": [dataclasses.asdict(b) for b in self.largest_at_peak],
            "warnings": list(self.warnings),
            "residuals": [dataclasses.asdict(r) for r in residuals],
        }


# ---- validation ------------------------------------------------------------------------------------


def check_shape(config: TransformerConfig, batch: int, seq: int, loss_chunks: int = 0) -> None:
    """Raise a clear error for a token shape or chunk count the model cannot take."""
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
    check_int("batch", batch)
    check_int("seq", seq)
    if seq > config.max_seq_len:
        raise ValueError(
            f"seq={seq} exceeds the model's max_seq_len={config.max_seq_len}; allowed: 1..{config.max_seq_len}"
        )
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 0:
        raise ValueError(f"loss_chunks must be 0 (plain loss) or a positive integer, got {loss_chunks!r}")
    if loss_chunks > batch * seq:
        raise ValueError(f"loss_chunks={loss_chunks} exceeds the token count {batch * seq}; allowed: 0..{batch * seq}")
    resolve_tiles(config.seq_tiles, batch, seq)  # tiles that do not divide the sequence: one line, before tracing


# ---- the training step -----------------------------------------------------------------------------


def optimizer(learning_rate: float = 1e-3, grad_accum: int = 1) -> optax.GradientTransformation:
    """The optimizer every measured step uses: ``train``'s clipped AdamW (:func:`..step.update.make_optimizer`)."""
    return step_lib.make_optimizer(learning_rate, grad_accum=grad_accum)


def train_step(model: Transformer, opt: optax.GradientTransformation, loss_chunks: int = 0):
    """The shared training step (:func:`remat_kit.step.update.make_step`) of the language-model loss (not jitted):
    ``(params, opt_state, tokens) -> (params, opt_state, loss, grad_norm, params_finite)``."""
    return step_lib.make_step(lambda p, tokens: lm_loss(model, p, tokens, loss_chunks=loss_chunks), opt)


def abstract_inputs(
    config: TransformerConfig, batch: int, seq: int, opt: optax.GradientTransformation, model: Any = None
):
    """``(params, opt_state, tokens)`` as ShapeDtypeStructs: nothing is allocated.

    ``model`` (default: the stock Transformer) gives the parameter tree, for models of another layout.
    """
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    if model is None:
        params = abstract_params(config)
    else:
        sample = jnp.zeros((1, min(8, seq)), jnp.int32)
        params = jax.eval_shape(lambda k: model.init(k, sample)["params"], jax.random.key(0))
    return params, jax.eval_shape(lambda p: step_lib.init_optimizer(opt, p), params), tokens


def compile_step(
    model: Transformer,
    batch: int,
    seq: int,
    loss_chunks: int = 0,
    learning_rate: float = 1e-3,
    mesh=None,
    *,
    dump: list | None = None,
):
    """Lower and compile the donated, jitted training step for abstract inputs.

    With a ``mesh`` (:mod:`remat_kit.step.mesh`) the step is compiled sharded (FSDP state, batch over
    ``data`` × ``fsdp``) and XLA's memory figures are per device.

    Returns:
      ``(compiled, jaxpr_flops, seconds)``: the compiled step (callable on real arrays of those
      shapes), its matmul FLOPs from the jaxpr, and the lower+compile time. With a ``dump`` list, XLA's dump
      of the compile is parsed (:mod:`remat_kit.analysis._xla_dump`) and appended to it.
    """
    opt = optimizer(learning_rate)
    args = abstract_inputs(model.config, batch, seq, opt, model)
    start = time.perf_counter()
    if mesh is not None:
        mesh_lib.check_batch(batch, mesh)
    kwargs = step_lib.jit_kwargs(args[0], args[1], mesh)
    traced = jax.jit(train_step(model, opt, loss_chunks), **kwargs).trace(*args)
    if dump is None:
        compiled = traced.lower().compile()
    else:
        compiled, program = _xla_dump.compile_with_dump(traced.lower())
        dump.append(program)
    seconds = time.perf_counter() - start
    return compiled, flops.jaxpr_flops(traced.jaxpr), seconds


# ---- residuals -------------------------------------------------------------------------------------


_short = inspection.short_source


def _block_candidates(config: TransformerConfig, policy: policies.Policy, batch: int, seq: int):
    """(shape, dtype) → labels of what one block keeps under ``policy`` (and its weights' paths).

    Stacked residuals of the scan carry no tags; one block analysed alone under the same JAX
    policy does, so the stack's residuals are matched to it by shape and dtype.
    """
    block = Block(config=config)
    x = jax.ShapeDtypeStruct((batch, seq, config.d_model), jnp.dtype(config.dtype))
    params = jax.eval_shape(lambda k: block.init(k, jnp.zeros(x.shape, x.dtype))["params"], jax.random.key(0))
    apply = lambda p, h: block.apply({"params": p}, h)
    # every_n keeps everything of its non-rematerialized layers: look at the plain block too.
    variants = [apply] if policy.kind in ("none", "every_n") else []
    if policy.remat:
        variants.append(jax.checkpoint(apply, policy=policy.jax_policy))
    found: dict[tuple, list[tuple[str, str | None]]] = collections.defaultdict(list)

    def add(key, label, tag):
        if (label, tag) not in found[key]:
            found[key].append((label, tag))

    for fn in variants:
        for r in _jax_internals.saved_residuals(lambda p, h, fn=fn: jnp.sum(fn(p, h)), params, x):
            if not r.is_argument:
                add((r.shape, r.dtype), r.tag or _short(r.source), r.tag)
    add((x.shape, str(x.dtype)), "layer_input", "layer_input")
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        # Kept as stored, or as the compute-dtype copy a mixed-precision Dense casts it to.
        for dtype in {str(leaf.dtype), config.dtype}:
            add((tuple(leaf.shape), dtype), f"weight layers.{name}", None)
    return found


def _stack_residuals(model: Transformer, params, batch: int, seq: int):
    x = jax.ShapeDtypeStruct((batch, seq, model.config.d_model), jnp.dtype(model.config.dtype))
    # The stack alone under a linear read-out (which keeps nothing): its residuals are the layers' share.
    stack_only = lambda p, h: jnp.sum(model.apply({"params": p}, h, method=lambda m, h: m.layers(h)))
    return [r for r in _jax_internals.saved_residuals(stack_only, params, x) if not r.is_argument]


def layer_stack_bytes(
    config: TransformerConfig, policy: policies.Policy | str, batch: int, seq: int, enforced: bool | None = None
) -> tuple[int, int]:
    """``(device, host)`` bytes the layer stack alone keeps for the backward pass: trace-only, fast.

    ``enforced``: whether offloaded bytes leave the device (default: the local rule,
    :func:`remat_kit.analysis.memory.host_offload`; a GPU target's planner passes its own).

    >>> cfg = TransformerConfig.preset("tiny", num_layers=16)
    >>> layer_stack_bytes(cfg, "sqrt_n", 2, 32)  # √16 = 4 group inputs [2, 32, 64] + their 4 int32 starts
    (65552, 0)
    """
    check_shape(config, batch, seq)
    policy = policies.parse(policy, num_layers=config.num_layers)
    layers = _stack_residuals(Transformer(config=config, policy=policy), abstract_params(config), batch, seq)
    return inspection.split_saved(layers, enforced)


def _fused_loss_labels(config: TransformerConfig, batch: int, seq: int, loss_chunks: int) -> dict:
    """``{(shape, dtype): label}`` of what the chunked (fused) loss keeps: the gradients it takes in the forward."""
    if not loss_chunks:
        return {}
    d, v = config.d_model, config.vocab_size
    size = -(-batch * seq // loss_chunks)
    matrix = (v, d) if config.tie_embeddings else (d, v)
    return {
        (matrix, config.param_dtype): "output matrix gradient (fused loss)",
        ((loss_chunks, size, d), config.dtype): "hidden-state gradient (fused loss)",
    }


def _residuals(config, policy, batch, seq, loss_chunks):
    model = Transformer(config=config, policy=policy)
    params = abstract_params(config)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    step = _jax_internals.saved_residuals(lambda p, t: lm_loss(model, p, t, loss_chunks=loss_chunks), params, tokens)
    layers = _stack_residuals(model, params, batch, seq)
    param_bytes = tree_bytes(params)

    # A mix's residuals are its parts' (stacked over each part's layers): label them by every part.
    parts = policy.parts if isinstance(policy, policies.Mix) else ((policy, config.num_layers),)
    stack_axes: set[int] = set()
    candidates: dict = collections.defaultdict(list)
    for part, count in parts:
        plan = part.plan(count)
        groups, rest = divmod(count, plan.size)
        stack_axes |= {count, groups, rest, plan.size, plan.size - 1} - {0}
        for key, labels in _block_candidates(config, part, batch, seq).items():
            candidates[key] += [label for label in labels if label not in candidates[key]]
    pool = collections.Counter((r.shape, r.dtype, r.host) for r in layers)
    fused = _fused_loss_labels(config, batch, seq, loss_chunks)
    out = []
    for r in step:
        if r.is_argument:
            continue
        key = (r.shape, r.dtype, r.host)
        region = "layers" if pool[key] > 0 else "head"
        if region == "layers":
            pool[key] -= 1
            label, tags = inspection.label_stacked(r.shape, r.dtype, candidates, stack_axes)
        else:
            label, tags = fused.get((r.shape, r.dtype), ""), ()
        if r.tag:
            label, tags = r.tag, (r.tag,)
        out.append(
            SavedResidual(
                region=region,
                label=label or _short(r.source),
                tags=tags,
                shape=r.shape,
                dtype=r.dtype,
                nbytes=r.nbytes,
                host=r.host,
                source=r.source,
            )
        )
    out.sort(key=lambda r: -r.nbytes)
    return tuple(out), layers, param_bytes


def breakdown(analysis: Analysis) -> dict[str, int]:
    """The layer stack's saved bytes by kind, to set beside Korthikanti's 34 · b · s · h per layer.

    Kinds: ``attention scores`` (a ``[..., seq, seq]`` tensor: probabilities or their exponentials,
    materialized by XLA's default attention; Korthikanti counts them apart, as 5 · a · s² · b),
    ``weight copies`` (weight slices or their compute-dtype casts, which Korthikanti does not
    count), and the remaining activations by dtype.
    """
    out: collections.Counter[str] = collections.Counter()
    for r in analysis.residuals:
        if r.region != "layers":
            continue
        if r.label.startswith("weight "):
            kind = "weight copies"
        elif list(r.shape).count(analysis.seq) >= 2:
            kind = "attention scores"
        else:
            kind = f"{r.dtype} activations"
        out[kind + (" (host)" if r.host else "")] += r.nbytes
    return dict(out.most_common())


# ---- the analysis ---------------------------------------------------------------------------------


def analyze(
    config: TransformerConfig,
    policy: policies.Policy | str,
    batch: int,
    seq: int,
    *,
    loss_chunks: int = 0,
    learning_rate: float = 1e-3,
    mesh=None,
    explain: bool = False,
    target=None,
) -> Analysis:
    """Measure one AdamW training step of ``config`` under ``policy``, compile-only.

    Args:
      config: the model (its ``dtype``/``param_dtype`` set the numerics).
      policy: a Policy or spec string.
      batch, seq: the token shape; ``seq`` at most ``config.max_seq_len``.
      loss_chunks: 0 for the plain loss over full logits, k > 0 for the chunked loss.
      learning_rate: AdamW's learning rate (does not change any figure; kept for the bench).
      mesh: a ``jax.sharding.Mesh`` or spec (``"data=2,fsdp=2"``): XLA's memory is then per device,
        and ``saved_bytes_per_device`` splits the residuals over the devices sharing the batch.
      explain: also read XLA's dump of the compile: ``at_peak``, ``largest_at_peak``, ``timeline``.
      target: the device compiled for (:func:`remat_kit.target.parse`; default ``"local"``); a GPU target's step
        is XLA:GPU's own, its kernels (cuDNN attention) included, offloaded residuals counted as host bytes.

    Returns:
      An :class:`Analysis`.

    Raises:
      ValueError/TypeError: a bad shape, chunk count or policy, before anything is traced.
    """
    return analyze_compiled(
        config,
        policy,
        batch,
        seq,
        loss_chunks=loss_chunks,
        learning_rate=learning_rate,
        mesh=mesh,
        explain=explain,
        target=target,
    )[0]


def analyze_compiled(
    config: TransformerConfig,
    policy: policies.Policy | str,
    batch: int,
    seq: int,
    *,
    loss_chunks: int = 0,
    learning_rate: float = 1e-3,
    mesh=None,
    explain: bool = False,
    target=None,
):
    """:func:`analyze`, also returning the compiled step so a benchmark can run it without recompiling.

    Returns:
      ``(Analysis, compiled)``; ``compiled(params, opt_state, tokens)`` donates params and state and
      returns ``(params, opt_state, loss, grad_norm, params_finite)``.
    """
    check_shape(config, batch, seq, loss_chunks)
    policy = policies.parse(policy, num_layers=config.num_layers)
    target = target_lib.parse(target)
    shown_mesh = mesh  # a compile-only target's one-device mesh is no mesh to report
    if target.elsewhere:
        mesh = target_mesh(target, mesh)
    elif isinstance(mesh, (str, mesh_lib.MeshSpec)):
        mesh = mesh_lib.make_mesh(mesh)
    if mesh is not None:
        mesh_lib.check_batch(batch, mesh)
    rule = host_offload(mesh.devices.flat[0] if mesh is not None else None)
    with target.tracing():  # the target's kernels (attention) in every trace below
        model = Transformer(config=config, policy=policy)
        residuals, layers, param_bytes = _residuals(config, policy, batch, seq, loss_chunks)
        dump: list | None = [] if explain else None
        compiled, count, seconds = compile_step(model, batch, seq, loss_chunks, learning_rate, mesh, dump=dump)
    memory = CompiledMemory.from_compiled(compiled)
    # One host rule (memory.host_offload): on CPU offloaded residuals stay device bytes.
    saved, saved_host = inspection.split_saved(residuals, rule.enforced)
    layers_saved, layers_host = inspection.split_saved(layers, rule.enforced)
    note = rule.note if any(r.host for r in residuals) else None
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    found = _explain(dump[0], memory, config, batch, seq, learning_rate, model, residuals) if dump else None
    warnings = explain_lib.offload_warnings(
        sum(r.nbytes for r in residuals if r.host),
        rule.enforced,
        explain_lib.policy_offloads(policy),
        memory.host,
    )
    notes = [] if note is None else [note]
    if found is not None:
        warnings += explain_lib.dominance_warnings(
            found.at_peak, found.total, has_optimizer=True, levers=explain_lib.CLI_LEVERS
        )
        notes += [n for n in (explain_lib.reserved_note(found.at_peak, found.total),) if n]
    else:
        warnings += explain_lib.dominance_warnings(
            _state_at_peak(config, batch, seq, learning_rate, model, memory),
            memory.total,
            has_optimizer=True,
            estimated=True,
            levers=explain_lib.CLI_LEVERS,
        )
    analysis = Analysis(
        policy=str(policy),
        config=config,
        batch=batch,
        seq=seq,
        loss_chunks=loss_chunks,
        residuals=residuals,
        saved_bytes=saved,
        saved_host_bytes=saved_host,
        layers_saved_bytes=layers_saved,
        layers_saved_host_bytes=layers_host,
        param_bytes=param_bytes,
        memory=memory,
        flops=count,
        xla_flops=float((cost or {}).get("flops", math.nan)),
        analytic=estimates_lib.analytic_flops(config, batch, seq),
        estimates=estimates_lib.estimates(config, batch, seq),
        compile_s=seconds,
        mesh=None if mesh is None or shown_mesh is None else f"data={mesh.shape['data']},fsdp={mesh.shape['fsdp']}",
        batch_devices=1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"],
        notes=tuple(notes),
        warnings=tuple(warnings),
        **inspection.StepRecord.explained(found),
    )
    return analysis, compiled


def _state_at_peak(config, batch, seq, learning_rate, model, memory: CompiledMemory) -> dict[str, int]:
    """The step's state by size without XLA's dump (:func:`remat_kit.analysis.explain.state_at_peak`): parameters and
    optimizer state as XLA counts its arguments (per device over a mesh), and the trainable parameters' gradients,
    which the clipped optimizer reads whole, at the same scale."""
    params, opt_state, tokens = abstract_inputs(config, batch, seq, optimizer(learning_rate), model)
    trainable, _ = lora.partition(params)
    # Over a mesh XLA's arguments are per device: the state is sharded alike, its gradients too.
    scale = memory.argument / max(tree_bytes((params, opt_state, tokens)), 1)
    return explain_lib.state_at_peak(
        int(tree_bytes(params) * scale), int(tree_bytes(opt_state) * scale), int(tree_bytes(trainable) * scale)
    )


def _explain(program, memory, config, batch, seq, learning_rate, model, residuals) -> explain_lib.Explanation:
    """The at-peak groups of the training step: its arguments are (params, opt_state, tokens), flattened."""
    params, opt_state, _ = abstract_inputs(config, batch, seq, optimizer(learning_rate), model)
    n_params, n_state = len(jax.tree.leaves(params)), len(jax.tree.leaves(opt_state))

    def group(n: int) -> str:
        return "parameters" if n < n_params else "optimizer state" if n < n_params + n_state else "inputs"

    grads = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params)]
    # A label names candidate tags ("mlp_gate|mlp_up") where only the shape tells them apart.
    tags = inspection.unique_tags(residuals)
    return explain_lib.explain(
        program,
        memory,
        parameter_groups=group,
        gradient_shapes=grads,
        tags=tags,
        residual_shapes=[(tuple(r.shape), str(r.dtype)) for r in residuals],
        has_optimizer=True,
    )


def analyze_policies(
    config: TransformerConfig,
    batch: int,
    seq: int,
    specs: list[policies.Policy],
    *,
    loss_chunks: int = 0,
    jobs: int = 1,
    progress=None,
    mesh=None,
    explain: bool = False,
    target=None,
) -> dict[str, Analysis]:
    """Analyze every policy in ``specs``, ``jobs`` at a time; ``progress(i, n, spec)`` is called before each.

    XLA compiles mostly on one core, so two jobs nearly halve the wall time on two cores; results
    do not depend on ``jobs`` (only each policy's ``compile_s`` does). With ``none`` among ``specs``, a
    policy that compiles to ``none``'s peak and saved set gets a warning
    (:func:`remat_kit.analysis.explain.noop_warning`);
    ``explain`` is :func:`analyze`'s.
    """
    check_int("jobs", jobs)

    def one(i: int, p: policies.Policy) -> Analysis:
        if progress:
            progress(i, len(specs), str(p))
        return analyze(config, p, batch, seq, loss_chunks=loss_chunks, mesh=mesh, explain=explain, target=target)

    if jobs == 1:
        results = {str(p): one(i, p) for i, p in enumerate(specs)}
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool, cancel_on_error(pool):
            futures = [pool.submit(one, i, p) for i, p in enumerate(specs)]
            results = {str(p): f.result() for p, f in zip(specs, futures, strict=True)}
    return with_noop_warnings(results)


def with_noop_warnings(results: dict[str, Analysis]) -> dict[str, Analysis]:
    """``results`` with a warning on each policy that compiles to ``none``'s peak and saved set (needs ``none``)."""
    noops = explain_lib.noop_warnings(results)
    return {
        name: dataclasses.replace(a, warnings=(noops[name], *a.warnings)) if name in noops else a
        for name, a in results.items()
    }
