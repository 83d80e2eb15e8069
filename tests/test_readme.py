"""The README is a front page: its Python blocks run and do what they say, it stays short, and every command line
and relative link of the README and docs/*.md is valid (the guides' blocks run in test_docs.py)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import max_rel_err
from doc_blocks import DOCS, PAGES, README, anchors, cli_commands, name, python_blocks, relative_links, run_block

from remat_kit import _jax_internals as internals

#: The issue's bound on the front page: a pitch, set-up, results, three examples, the policies, the CLI, links.
MAX_README_LINES = 250


def _block_under_policy(ns):
    """selective(save=[...])(MyBlock): keeps only mlp_up of the block; MyBlock's parameters and gradients."""
    x, params, bare = ns["x"], ns["params"], ns["MyBlock"]()

    def kept(block):  # the block's own values the backward pass keeps (x and the weights are arguments here)
        fn = lambda p, x: jnp.sum(block.apply(p, x))
        return [r.source for r in internals.saved_residuals(fn, params, x) if not r.is_argument]

    assert kept(ns["RematBlock"]()) and all("named 'mlp_up'" in s for s in kept(ns["RematBlock"]()))
    assert any("named" not in s for s in kept(bare))  # without the policy the gelu's values are kept too
    assert jax.tree.structure(params) == jax.tree.structure(bare.init(jax.random.key(0), x))
    want = jax.grad(lambda p: jnp.sum(bare.apply(p, x) ** 2))(params)
    assert max_rel_err(ns["grads"], want) <= 1e-5


def _stack(ns):
    """remat_kit.stack: parameters stacked on axis 0; the gradients of the same stack without remat."""
    assert ns["params"]["params"]["layers"]["Dense_0"]["kernel"].shape == (8, 64, 256)
    plain = ns["remat_kit"].stack(ns["MyBlock"], num_layers=8, policy="none")
    want = jax.grad(lambda p: jnp.sum(plain.apply(p, ns["x"]) ** 2))(ns["params"])
    assert max_rel_err(ns["grads"], want) <= 1e-5


def _apply(ns):
    """remat_kit.apply(..., scan=True) on an unedited model: the plain model's tree and gradients."""
    plain, x = ns["Model"](), ns["x"]
    assert set(ns["remat_kit"].names_of(plain, x).names) == {"layer_input", "up", "up/kernel", "down", "down/kernel"}
    assert jax.tree.structure(ns["params"]) == jax.tree.structure(plain.init(jax.random.key(0), x))
    want = jax.grad(lambda p: plain.apply(p, x).sum())(ns["params"])
    assert max_rel_err(ns["grads"], want) <= 1e-5


#: A marker found in a README block → what to assert after running it.
README_CHECKS = {
    'remat_kit.policies.selective(save=["mlp_up"])(MyBlock)': _block_under_policy,
    'remat_kit.stack(MyBlock, num_layers=8, policy="every_n:2")': _stack,
    'remat_kit.apply(Model(), "selective:up", scan=True)': _apply,
}
BLOCKS = python_blocks(README)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(index):
    run_block(README, index, README_CHECKS)


def test_every_readme_block_is_checked():
    """Each README block has its check, and each check its block: a block edited away from its marker fails here."""
    assert [marker for marker in README_CHECKS if not any(marker in b for b in BLOCKS)] == []
    assert [b[:60] for b in BLOCKS if not any(marker in b for marker in README_CHECKS)] == []


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move the detail to docs/"
    assert "python -m pytest -q -n 2 --dist loadfile" in README.read_text()  # CI runs the README's test command
    assert {f"docs/{page.name}" for page in DOCS} <= set(relative_links(README))  # every guide is linked


def test_every_command_line_parses():
    """The shell blocks' remat-kit commands use flags and choices the CLI has (parsed, not run: they train)."""
    from remat_kit import cli

    commands = cli_commands(PAGES)
    assert len(commands) >= 8 and {argv[0] for _, argv in commands} >= {"bench", "plan", "train", "tags"}
    parser = cli.build_parser()
    for page, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit as e:  # argparse's way of saying "no such flag / bad choice"
            raise AssertionError(f"{page}: command does not parse: remat-kit {' '.join(argv)}") from e


@pytest.mark.parametrize("page", PAGES, ids=[name(p) for p in PAGES])
def test_relative_links_resolve(page):
    """Every relative link names a file that exists, and an anchor a heading of that file."""

    def resolves(target: str) -> bool:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        return dest.exists() and (not anchor or (dest.suffix == ".md" and anchor in anchors(dest)))

    assert [target for target in relative_links(page) if not resolves(target)] == []
