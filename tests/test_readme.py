"""The README's library examples run as written (on the 8 simulated devices)."""
import pathlib
import re

import jax.numpy as jnp

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _block(marker: str) -> str:
    found = [b for b in BLOCKS if marker in b]
    assert len(found) == 1, f"one README example with {marker!r}"
    return found[0]


def test_nnx_example_trains_and_its_orbax_checkpoint_restores(tmp_path):
    scope: dict = {}
    exec(compile(_block("nnx.split(MLP"), "README nnx example", "exec"), scope)
    assert float(scope["loss"]) < 1.0 and type(scope["params"]).__name__ == "State"
    # the orbax example, on the trained nnx example's state
    orbax = _block("ocp.StandardCheckpointer()").replace("/abs/path/ckpt", str(tmp_path / "ckpt"))
    saved = {"params": scope["params"], "opt_state": scope["opt_state"]}
    exec(compile(orbax, "README orbax example", "exec"), scope)
    import jax
    for a, b in zip(jax.tree.leaves(scope["restored"]), jax.tree.leaves(saved)):
        assert (jnp.asarray(a) == jnp.asarray(b)).all()


def test_units_example_trains():
    scope: dict = {}
    exec(compile(_block("osdp_jax.units.find(loss_fn"), "README units example", "exec"), scope)
    assert sorted(set(scope["units"].values())) == [f"block_{i}" for i in range(6)]
    assert scope["layout"].units and float(scope["loss"]) > 0
