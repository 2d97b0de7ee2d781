"""What ``Plan.summary()`` prints: groups and the ungrouped view, segment lines, the padding note."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import osdp_jax
from osdp_jax import Segment


def test_summary_groups_alike_parameters_and_can_list_each_one(mesh):
    params = {"gate": jnp.zeros((64, 128)), "up": jnp.zeros((64, 128)), "down": jnp.zeros((128, 64))}
    plan = osdp_jax.plan(params, mesh, budget=2**30, strategies=("zero3",))
    grouped, each = plan.summary(), plan.summary(group=False)
    assert "(+1)" in grouped and sum(line.startswith(("gate", "up")) for line in grouped.splitlines()) == 1
    assert "(+1)" not in each
    assert {line.split()[0] for line in each.splitlines() if line.startswith(("gate", "up", "down"))} == {
        "gate", "up", "down"}


def test_segments_that_run_alike_print_as_one():
    from osdp_jax.core.plan import describe_segments
    alike = (Segment(0, 4, "zero3", 1, "full", P(None, "data")), Segment(4, 6, "zero3", 1, "full", P(None, "data")))
    assert describe_segments(alike) == "layers 0-5 zero3, remat=full"
    differ = (Segment(0, 4, "zero3", 1, "dots"), Segment(4, 6, "zero3", 2, "dots"))
    assert describe_segments(differ) == "layers 0-3 zero3, 4-5 zero3 k=2, remat=dots"
    remat = (Segment(0, 2, "zero3", 1, "dots"), Segment(2, 6, "zero3", 1, "full"))
    assert describe_segments(remat) == "layers 0-1 zero3 remat=dots, 2-5 zero3 remat=full"


def test_padding_note_only_where_padding_a_matrix_row_count_helps(mesh):
    """Sharded along a later dimension because 8 devices do not divide the first: the note names
    padding for a (63, 64) kernel (one row more), not for a conv kernel's spatial dimension nor
    for a scanned stack's layer count."""
    note = "padding that first dimension"
    kernel = osdp_jax.plan({"w": jnp.zeros((63, 64))}, mesh, budget=2**30, strategies=("zero3",))
    conv = osdp_jax.plan({"w": jnp.zeros((3, 3, 3, 32))}, mesh, budget=2**30, strategies=("zero3",))
    stack = osdp_jax.plan({"w": jnp.zeros((6, 64, 64))}, mesh, budget=2**30, strategies=("zero3",))
    assert jax.tree.leaves(conv.strategies) == ["zero3"] and jax.tree.leaves(stack.strategies) == ["zero3"]
    assert note in kernel.summary() and note not in conv.summary() and note not in stack.summary()


def test_log_records_during_a_progress_bar_are_written_through_tqdm(monkeypatch):
    """A warning logged while the planner's progress bar runs is written with ``tqdm.write`` (above
    the bar), not into the bar's line."""
    import logging

    from tqdm import std

    from osdp_jax.planner.pipeline import _progress
    written = []
    monkeypatch.setattr(std.tqdm, "write", classmethod(lambda cls, s, *a, **k: written.append(s)))
    for i in _progress([1, 2], "osdp-jax: test"):
        logging.getLogger("osdp_jax").warning("record %d", i)
    assert written == ["record 1", "record 2"]
