"""The README's example runs as written (a user's first contact with the API)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    grads = namespace["grads"]["params"]["layers"]
    assert grads["Dense_0"]["kernel"].shape == (24, 256, 1024)
    assert namespace["policy"].save == ("mlp_up",)
