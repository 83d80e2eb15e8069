"""remat_kit.apply on models installed from the registry, unedited: compile time and compiled memory.

Per model (google-tunix's Llama3 and Qwen3, NNX; gemma's gm.nn Gemma3_270M, Linen; each shrunk from its own
config class, random weights, pins in ci/thirdparty.txt, Python >= 3.12):

* compile time of the gradient (jit + lower + compile, wall seconds) of the plain model, ``apply(model, "full")``
  and ``apply(model, "full", scan=True)`` at 4, 8 and 16 layers: a Python loop compiles every block, the scan one;
* per policy at 8 layers, loop and scan: JAX's saved residual bytes and the compiled gradient's peak (arguments +
  outputs + temp), from remat_kit.compare (compile-only, nothing runs).

A row that fails says why in one line instead of numbers.

    pip install --no-deps -r ci/thirdparty.txt   # into a Python >= 3.12 venv with `pip install -e .[test]`
    python benchmarks/thirdparty.py > benchmarks/results/thirdparty.txt
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import remat_kit
from remat_kit.units import fmt_bytes

DEPTHS = (4, 8, 16)
POLICY_DEPTH = 8
BATCH, SEQ, VOCAB, WIDTH = 8, 128, 256, 64
POLICIES = ["none", "full", "every_n:2", "SELECTIVE", "offload:attn/*", "offload", "dots"]
PACKAGES = ("google-tunix", "gemma", "jax", "flax")


def _tunix(family: str, n: int):
    if family == "llama3":
        from tunix.models.llama3 import model as m

        cls, config = m.Llama3, m.ModelConfig.llama3p2_1b()
    else:
        from tunix.models.qwen3 import model as m

        cls, config = m.Qwen3, m.ModelConfig.qwen3_0p6b()
    tiny = dataclasses.replace(
        config,
        num_layers=n,
        vocab_size=VOCAB,
        embed_dim=WIDTH,
        hidden_dim=4 * WIDTH,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
    )
    return cls(tiny, rngs=nnx.Rngs(0))


def _gemma(n: int):
    from gemma import gm
    from gemma.gm.nn import _config, _gemma

    tiny = dataclasses.replace(
        gm.nn.Gemma3_270M.config,
        num_embed=VOCAB,
        embed_dim=WIDTH,
        hidden_dim=4 * WIDTH,
        num_heads=4,
        head_dim=16,
        num_kv_heads=1,
        sliding_window_size=32,
        attention_types=_config.make_attention_layers_types(_gemma.GEMMA3_ATTENTION_PATTERN, num_layers=n),
    )
    return gm.nn.Gemma3_270M(config=tiny, dtype=jnp.float32)


POSITIONS = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
CAUSAL = jnp.broadcast_to(jnp.tril(jnp.ones((SEQ, SEQ), bool)), (BATCH, SEQ, SEQ))
TOKENS = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)


def _xent(logits):
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))


MODELS = {
    "tunix llama3": (True, lambda n: _tunix("llama3", n), "selective:attn/q_proj,attn/k_proj,mlp/gate_proj"),
    "tunix qwen3": (True, lambda n: _tunix("qwen3", n), "selective:attn/q_proj,attn/k_proj,mlp/gate_proj"),
    "gemma gm.nn": (False, _gemma, "selective:attn/q_einsum,attn/kv_einsum,mlp/gating_einsum"),
}


def _nnx_loss(model, tokens):
    return _xent(model(tokens, POSITIONS, None, CAUSAL)[0])


def _linen_loss(model, variables, tokens):
    return _xent(model.apply(variables, tokens).logits)


def _setup(is_nnx: bool, make, n: int):
    """``(plain loss(params, tokens), params (abstract for Linen), make_loss(policy, scan))``."""
    model = make(n)
    if is_nnx:
        params = nnx.state(model, nnx.Param)
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        plain = lambda p, t: _nnx_loss(nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest)), t)
        loss = _nnx_loss
    else:
        params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones(TOKENS.shape, jnp.int32)))
        plain = lambda v, t: _linen_loss(model, v, t)
        loss = _linen_loss
    return plain, params, lambda policy, scan: remat_kit.apply_factory(model, loss, scan=scan)(policy)


def _error(err: Exception) -> str:
    return f"error: {type(err).__name__}: {str(err).splitlines()[0][:100]}"


def _compile_seconds(loss, params) -> str:
    start = time.perf_counter()
    try:
        jax.jit(jax.grad(loss)).lower(params, TOKENS).compile()
    except Exception as err:
        return _error(err)
    return f"{time.perf_counter() - start:.1f}"


def _memory_row(name: str, layout: str, policy: str, report) -> str:
    saved, peak = fmt_bytes(report.saved_bytes), fmt_bytes(report.peak_bytes)
    return f"{name:<14} {layout:<6} {policy:<58} {saved:>10} {peak:>10}"


def main() -> None:
    start = time.perf_counter()
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in PACKAGES)
    print(f"# command: python benchmarks/thirdparty.py  ({versions}; {jax.default_backend()})")
    print(f"# python {sys.version.split()[0]}; tiny configs from each model's own config class: width {WIDTH}, ")
    print(f"# vocab {VOCAB}, batch {BATCH} x seq {SEQ}; gemma: Gemma 3's pattern (5 local, 1 global)")
    print()
    print("## compile time of the gradient (s): plain vs apply(full) vs apply(full, scan=True)")
    print(f"{'model':<14} {'layers':>6} {'plain':>8} {'applied':>8} {'scan':>8}")
    for name, (is_nnx, make, _) in MODELS.items():
        for n in DEPTHS:
            plain, params, make_loss = _setup(is_nnx, make, n)
            cells = [_compile_seconds(plain, params)]
            for scan in (False, True):
                try:
                    cells.append(_compile_seconds(make_loss("full", scan), params))
                except Exception as err:
                    cells.append(_error(err))
            if any(c.startswith("error") for c in cells):
                print(f"{name:<14} {n:>6} " + " | ".join(cells))
            else:
                print(f"{name:<14} {n:>6} {cells[0]:>8} {cells[1]:>8} {cells[2]:>8}")
    print()
    print(f"## saved residuals and compiled peak per policy, {POLICY_DEPTH} layers (remat_kit.inspect, compile-only)")
    print(f"{'model':<14} {'layout':<6} {'policy':<58} {'saved':>10} {'peak':>10}")
    for name, (is_nnx, make, selective) in MODELS.items():
        plain, params, make_loss = _setup(is_nnx, make, POLICY_DEPTH)
        print(_memory_row(name, "plain", "(no remat_kit)", remat_kit.inspect(plain, params, TOKENS)))
        for scan in (False, True):
            layout = "scan" if scan else "loop"
            for policy in [selective if p == "SELECTIVE" else p for p in POLICIES]:
                try:
                    report = remat_kit.inspect(make_loss(policy, scan), params, TOKENS)
                except Exception as err:
                    print(f"{name:<14} {layout:<6} {policy:<58} {_error(err)}")
                    continue
                print(_memory_row(name, layout, policy, report))
    print(f"# wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
