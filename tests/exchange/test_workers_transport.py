"""`tfs.exchange.workers`' choice of transport for lookups of tables sharded across workers, and its cost model.

The transports themselves run across two worker processes in `tests/strategy/test_multi_worker.py` (each
against NumPy, with the collective each leaves in the graph checked) and in B12 (timed side by side).
"""

import itertools

import pytest
import tensorflow as tf

from tf_sharded.exchange import cost, workers


def test_the_all_to_all_costs_less_at_every_size_even_with_every_id_at_one_owner():
    for replicas, u, row_bytes in itertools.product((2, 4, 16), (1, 100, 4096, 10**6), (4, 64, 512)):
        spread = cost.sharded_transport_costs(replicas, u, row_bytes)
        skewed = cost.sharded_transport_costs(replicas, u, row_bytes, chunk=u)  # one owner gets all of them
        assert spread["alltoall"] < spread["gather"], (replicas, u, row_bytes, spread)
        assert skewed["alltoall"] < skewed["gather"], (replicas, u, row_bytes, skewed)
        assert spread["alltoall"] <= skewed["alltoall"]


def test_rendezvous_count_four_against_five_and_are_left_out_for_the_planner():
    with_waits = cost.sharded_transport_costs(2, 512, 64)
    without = cost.sharded_transport_costs(2, 512, 64, rendezvous=False)
    assert with_waits["alltoall"] - without["alltoall"] == 4 * cost.RENDEZVOUS_BYTES
    assert with_waits["gather"] - without["gather"] == 5 * cost.RENDEZVOUS_BYTES
    # The planner's sharded estimate across workers is the chosen transport's bytes.
    placed = cost.placement_costs(rows=100_000, row_bytes=64, replicas=2, distinct_ids=512)
    assert placed["sharded"] == without["alltoall"]
    gathered = cost.placement_costs(rows=100_000, row_bytes=64, replicas=2, distinct_ids=512, transport="gather")
    assert gathered["sharded"] == without["gather"]


def test_traced_steps_take_the_all_to_all_eager_ones_and_forced_ones_the_gather_form():
    seen = {}

    @tf.function
    def traced():
        seen["chosen"] = workers.transport_for(2, 64, 4096)
        seen["unknown bound"] = workers.transport_for(4, 4, None)
        with workers.transport_scope("gather"):
            seen["forced"] = workers.transport_for(2, 64, 4096)
            with workers.transport_scope("alltoall"):
                seen["innermost"] = workers.transport_for(2, 64, 4096)
            seen["after the inner scope"] = workers.transport_for(2, 64, 4096)
        return tf.constant(0)

    traced()
    assert seen == {"chosen": "alltoall", "unknown bound": "alltoall", "forced": "gather",
                    "innermost": "alltoall", "after the inner scope": "gather"}  # fmt: skip
    assert workers.transport_for(2, 64, 4096) == "gather"  # eagerly
    with workers.transport_scope("alltoall"):
        assert workers.transport_for(2, 64, 4096) == "gather"


def test_an_unknown_transport_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"Argument `transport` must be one of \('alltoall', 'gather'\)\. "
                                         r"Received: transport='nccl'"):  # fmt: skip
        with workers.transport_scope("nccl"):
            pass
    chosen = []
    tf.function(lambda: chosen.append(workers.transport_for(2, 64, 10)) or tf.constant(0))()
    assert chosen == ["alltoall"]  # the refused scope left nothing forced
