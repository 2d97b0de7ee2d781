"""The compatibility readers (``osdp_jax.core.compat``) on the installed JAX: CI runs this module on the
oldest and the newest JAX the package supports."""
import jax
import jax.numpy as jnp
import pytest

from osdp_jax.core.compat import scan_operand_counts, supported_compile_options, supported_xla_flags


def _scan_params(fn, *args):
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "scan"]
    return eqn, eqn.params


def test_scan_operand_counts_split_constants_carry_and_xs():
    """A scan closing over two arrays, with a two-part carry and two per-iteration operands: its
    operands are read as constants, then carry, then xs, and the xs are the stacked arrays."""
    w, v = jnp.arange(4.0), jnp.arange(3.0)

    def loop(c, d, xs, ys):
        def body(carry, x):
            a, b = carry
            return (a + (x[0] * w).sum() + b, b * (x[1] * v).sum()), a
        return jax.lax.scan(body, (c, d), (xs, ys))

    eqn, params = _scan_params(loop, 1.0, 2.0, jnp.ones((5, 4)), jnp.ones((5, 3)))
    consts, carry = scan_operand_counts(params)
    assert carry == 2
    xs = [v.aval.shape for v in eqn.invars[consts + carry:]]
    assert xs == [(5, 4), (5, 3)]
    assert consts + carry + len(xs) == len(eqn.invars)


def test_scan_without_constants():
    eqn, params = _scan_params(lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c), c, xs), jnp.zeros(3), jnp.ones((2,
                                                                                                                   3)))
    assert scan_operand_counts(params) == (0, 1)


def test_compile_options_the_running_xla_does_not_know_are_left_out():
    kept = supported_compile_options({"xla_backend_optimization_level": 0, "xla_no_such_option_here": 1}, "cpu")
    assert kept == {"xla_backend_optimization_level": 0}
    assert supported_compile_options({"xla_no_such_option_here": 1}, "cpu") is None
    assert supported_compile_options(None, "cpu") is None
    # what is kept compiles
    jax.jit(lambda x: x * 2).lower(jnp.ones(3)).compile(compiler_options=kept)


@pytest.mark.slow
def test_xla_flags_the_installed_xla_does_not_know_are_left_out():
    flags = ["--xla_force_host_platform_device_count=2", "--xla_no_such_flag_here=true"]
    assert supported_xla_flags(flags) == ["--xla_force_host_platform_device_count=2"]
