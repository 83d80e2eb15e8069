"""``remat-kit policies``: the policies, MaxText presets and checkpoint tags; ``policies SPEC`` explains one spec.

The card is generated from :mod:`remat_kit.policies` itself (each kind's constructor docstring, the
preset table, the tag vocabulary), so it cannot drift from the code or repeat the README's table.
"""

from __future__ import annotations

import argparse
import json

from remat_kit.cli.common import add_parser


def card() -> dict:
    """The reference card as data: each kind's one-line summary, the presets, the tags and their aliases."""
    from remat_kit import names, policies

    def summary(kind: str) -> str:
        doc = getattr(getattr(policies, policies.CONSTRUCTORS.get(kind, kind), None), "__doc__", None) or ""
        return doc.strip().splitlines()[0].replace("``", "").replace(":func:", "") if doc.strip() else ""

    return {
        "policies": {kind: summary(kind) for kind in policies.KINDS},
        "grammar": policies.SPEC_GRAMMAR,
        "maxtext_presets": {name: str(policies.parse(name)) for name in policies.MAXTEXT_ALIASES},
        "selective_default": list(policies.SELECTIVE_DEFAULT),
        "tags": list(names.VOCABULARY),
        "aliases": {alias: list(tags) for alias, tags in names.ALIASES.items()},
    }


def _keeps(p) -> tuple[str, str]:
    """``(keeps, recomputes)`` in words for one (non-mix) policy."""
    if p.kind == "every_n":
        n = p.period
        return (
            f"everything in layers not divisible by {n}; only the input of layers 0, {n}, {2 * n}, …",
            f"layers 0, {n}, {2 * n}, …",
        )
    if p.kind == "selective":
        return "each layer's input and the tagged values " + ",".join(p.save), "every other value in each layer"
    if p.kind == "offload":
        saved = ",".join(p.save) if p.save else "no tagged value"
        offloaded = ",".join(p.offload)
        return f"on the device: {saved}; in host memory: {offloaded}", "every value neither saved nor offloaded"
    if p.kind == "jax":
        what = {
            "everything_saveable": "every activation",
            "nothing_saveable": "each layer's input",
            "dots_saveable": "each layer's input and every matmul output",
            "dots_with_no_batch_dims_saveable": "each layer's input and matmul outputs without batch dimensions",
            "save_only_these_names": "each layer's input and the values named " + ",".join(p.names),
        }.get(p.upstream, f"what the JAX policy {p.upstream} saves")
        return what, "every other value in each layer (jax.checkpoint under that policy)"
    if p.kind == "segments":
        return f"the input of every group of {p.group_size} layers", f"{p.group_size} layers at a time"
    return {
        "none": ("every activation", "nothing"),
        "full": ("each layer's input", "each whole layer"),
        "sqrt_n": ("every k-th layer boundary, k ≈ √L (e.g. L=16: k=4)", "k layers at a time"),
        "dots": ("matmul outputs without batch dimensions", "everything else"),
    }.get(p.kind, ("see the policy's docstring", "-"))


def describe(spec: str) -> dict:
    """What one policy spec means: its canonical form, what the backward pass keeps, recomputes and offloads.

    A mix (``"selective*20+full*8"``) is described part by part, with the layers each part covers.
    """
    from remat_kit import policies

    p = policies.parse(spec)
    if isinstance(p, policies.Mix):
        first, keeps, recomputes, offloads = 0, [], [], []
        for part, count in p.parts:
            k, r = _keeps(part)
            where = f"layers {first}–{first + count - 1} ({part})"
            keeps.append(f"{where}: {k}")
            recomputes.append(f"{where}: {r}")
            offloads += [t for t in part.offload if t not in offloads]
            first += count
        dst = next((q.dst for q in p.policies if q.offload), None)
        keeps_text, recomputes_text, strict = "; ".join(keeps), "; ".join(recomputes), all(q.strict for q in p.policies)
    else:
        (keeps_text, recomputes_text), offloads, strict = _keeps(p), list(p.offload), p.strict
        dst = p.dst if p.offload else None
    return {
        "spec": spec,
        "policy": str(p),
        "kind": p.kind,
        "keeps": keeps_text,
        "recomputes": recomputes_text,
        "offloads": offloads,
        "offload_to": dst,
        "strict": strict,
        "repr": repr(p),
    }


def _policies_command(args: argparse.Namespace) -> int:
    if args.spec is not None:  # "" is refused by the parser, not taken for "no spec"
        info = describe(args.spec)
        if args.json:
            print(json.dumps(info, indent=1))
            return 0
        same = "" if info["policy"] == args.spec else f" = {info['policy']}"
        print(f"{args.spec}{same} ({info['kind']})")
        print(f"  keeps:      {info['keeps']}")
        print(f"  recomputes: {info['recomputes']}")
        if info["offloads"]:
            print(f"  offloads:   {','.join(info['offloads'])} to {info['offload_to']} (XLA:CPU moves nothing)")
        if not info["strict"]:
            print("  strict:     off (tags the code does not emit are ignored)")
        print(f"  as Python:  {info['repr']}")
        return 0
    c = card()
    if args.json:
        print(json.dumps(c, indent=1))
        return 0
    width = max(map(len, c["policies"])) + 2
    for kind, text in c["policies"].items():
        print(f"{kind:{width}} {text}")
    print("\nMaxText presets:")
    for name, spec in c["maxtext_presets"].items():
        print(f"  {name:{max(map(len, c['maxtext_presets']))}} = {spec}")
    print("default selective keeps: " + ",".join(c["selective_default"]))
    print("\ncheckpoint tags: " + ", ".join(c["tags"]))
    print("aliases: " + ", ".join(f"{a}={'+'.join(t)}" for a, t in c["aliases"].items()))
    print("\nspec grammar: " + c["grammar"])
    print("\n`remat-kit policies SPEC` explains one spec, e.g. every_n:2 or selective:q_proj,k_proj")
    return 0


def add_cli(subparsers) -> None:
    """Register ``remat-kit policies``."""
    p = add_parser(
        subparsers,
        "policies",
        help="list the policies, MaxText presets and checkpoint tags, or explain one policy spec",
    )
    p.add_argument("spec", nargs="?", help="a policy spec to explain (e.g. every_n:2, minimal, selective:q_proj)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_policies_command)
