"""Per-device bytes of the training step over simulated CPU meshes (data and fsdp), compile-only.

Activations (saved residuals, XLA temp) should fall as 1/data with the batch split over ``data``;
parameters + optimizer state as 1/fsdp. Usage::

    python benchmarks/mesh_scaling.py --preset small --policy full --devices 4
"""

from __future__ import annotations

import argparse
import math
import os


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--policy", default="full")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    args = ap.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts
    from remat_kit import policies
    from remat_kit.model.transformer import PRESET_SHAPES, TransformerConfig
    from remat_kit.planning import analysis, builtin
    from remat_kit.planning import budget as auto
    from remat_kit.step import mesh as M
    from remat_kit.units import fmt_bytes

    cfg = TransformerConfig.preset(args.preset)
    batch = args.batch or max(PRESET_SHAPES[args.preset][0], args.devices)
    seq = args.seq or PRESET_SHAPES[args.preset][1]
    policy = policies.parse(args.policy)
    opt = auto.get_optimizer("adamw")
    params, opt_state, _ = analysis.abstract_inputs(cfg, batch, seq, opt)
    saved = analysis.analyze(cfg, policy, batch, seq).saved_bytes  # global; split over data x fsdp

    def state_bytes(mesh):
        total = 0
        for tree in (params, opt_state):
            shardings = M.tree_shardings(tree, mesh)
            for leaf, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
                total += math.prod(s.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        return total

    print(f"preset {args.preset}, policy {policy}, batch {batch} x seq {seq}, AdamW; {os.cpu_count()} CPU cores\n")
    header = (
        f"{'mesh':14} {'saved/device':>13} {'x1/':>6} {'temp/device':>12} {'x1/':>6} {'state/device':>13} {'x1/':>6}"
    )
    print(header)
    base = None
    for spec in ("data=1", "data=2", "data=4", "fsdp=2", "fsdp=4", "data=2,fsdp=2"):
        ms = M.MeshSpec.parse(spec)
        if ms.size > args.devices or args.devices % ms.size:
            continue
        devices = jax.devices()[: ms.size]
        mesh = M.make_mesh(ms, devices)
        mem = builtin.Planner(cfg, mesh=mesh).compiled_memory(policy, batch, seq)
        row = (saved / ms.size, mem.temp, state_bytes(mesh))
        base = base or row
        ratios = [b / r if r else float("nan") for b, r in zip(base, row, strict=True)]
        print(
            f"{ms!s:14} {fmt_bytes(row[0]):>13} {ratios[0]:6.2f} {fmt_bytes(row[1]):>12} {ratios[1]:6.2f} "
            f"{fmt_bytes(row[2]):>13} {ratios[2]:6.2f}"
        )
    print(
        "\nx1/: the single-device figure divided by this one (ideal: data x fsdp for saved and temp, fsdp for state)."
    )
    print(
        "saved/device: the step's saved residuals (global, from JAX's residual analysis) over the devices that split"
        " the batch;\ntemp/device: XLA's temp bytes of the sharded executable (activations, gradients, workspace);\n"
        "state/device: parameters + AdamW moments, from each array's shard shape."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
