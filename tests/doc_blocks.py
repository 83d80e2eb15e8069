"""The code blocks of the README and of docs/*.md, for test_readme.py and test_docs.py.

A Python block runs as written, in a fresh namespace (a reader's first contact); a check keyed by a marker string
found in the block then asserts what the block claims.
"""

import pathlib
import re
import shlex
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

Check = Callable[[dict], None]


def name(page: pathlib.Path) -> str:
    """The page's path from the repository root (README.md, docs/planning.md)."""
    return page.relative_to(ROOT).as_posix()


def python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def run_block(page: pathlib.Path, index: int, checks: dict[str, Check]) -> None:
    """Run the page's Python block ``index``, then every check whose marker is in it."""
    source = python_blocks(page)[index]
    namespace: dict = {"__name__": f"doc_block_{index}"}
    exec(compile(source, f"{name(page)}[python block {index}]", "exec"), namespace)
    for marker, check in checks.items():
        if marker in source:
            check(namespace)


def cli_commands(pages: list[pathlib.Path]) -> list[tuple[str, list[str]]]:
    """Every ``remat-kit`` command line of the pages' shell blocks: (page, argv), continuations joined."""
    commands = []
    for page in pages:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if "remat-kit" in " ".join(words) and "..." not in words:  # "train ... --resume" elides its flags
                    start = next(i for i, w in enumerate(words) if w.endswith("remat-kit"))
                    commands.append((name(page), words[start + 1 :]))
    return commands


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    """The anchors of the page's headings (code blocks left out: a shell comment is no heading)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def relative_links(page: pathlib.Path) -> list[str]:
    """The page's Markdown link and image targets that are not URLs (code blocks and spans left out)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]
