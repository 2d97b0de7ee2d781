"""The README's quickstart runs as written (on the 8 simulated devices), and the README stays a
landing page."""
import pathlib
import re

from flax import nnx

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_quickstart_trains_and_gives_back_an_nnx_module():
    (quickstart,) = BLOCKS
    scope: dict = {}
    exec(compile(quickstart, "README quickstart", "exec"), scope)
    assert float(scope["loss"]) < 1.0 and type(scope["params"]).__name__ == "State"
    assert isinstance(scope["model"], nnx.Module)
    assert scope["plan"].xla_peak_bytes <= scope["plan"].budget_bytes


def test_readme_is_a_landing_page():
    assert len(README.splitlines()) <= 300 and len(README.encode()) <= 25 * 1024
    assert len(BLOCKS[0].splitlines()) <= 40
