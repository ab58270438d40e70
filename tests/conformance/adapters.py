"""What the conformance checks need of each table kind, keyed by the kind's registered name.

An adapter says how to make a table of its kind under a strategy (with a `placement=` option or the
strategy's default), which keys to look up, what a fresh table holds for them (the single-device
reference), how to read the rows a table holds now (and the per-key columns it keeps beside them), and which
other layouts a checkpoint restores into. The checks themselves (`test_conformance.py`) are the same for
every kind; a kind whose tables hold no trainable rows or write no checkpoint says so (`trains`, `layouts`)
and those checks are skipped for it. A kind may have several adapters (a variant each, e.g. the key dtype of
dynamic tables): the matrix runs each, named by its key in `ADAPTERS`, and `kind` names its kind.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tests.conformance import minimal_kind
from tests.harness.references import table_values


class KindAdapter:
    """The default adapter: tables with rows, trained through their `held_variables`, checkpointed whole."""

    # The registered kind the adapter's tables are of.
    kind = None
    # Whether its tables hold rows an optimizer trains.
    trains = True
    # Layouts (the keyword arguments of `make`) a checkpoint restores into; empty: no checkpoint.
    layouts = ()
    # The layout the matrix makes its tables with.
    layout = {}

    def make(self, strategy, name: str, option, **layout):
        """A table of this kind made under `strategy` (in its scope) with the `placement=` option `option` (None:
        the strategy's default)."""
        raise NotImplementedError

    def keys(self, rng, n: int) -> np.ndarray:
        """`n` keys to look up, with repeats."""
        raise NotImplementedError

    def initial(self, table, keys: np.ndarray) -> np.ndarray:
        """The rows a fresh `table` holds for `keys`, computed without it (a single-device reference)."""
        raise NotImplementedError

    def live_keys(self, table) -> list:
        """The keys `table` holds rows for."""
        raise NotImplementedError

    def read(self, table, keys: list) -> np.ndarray:
        """The rows `table` holds for `keys` (read without changing it)."""
        raise NotImplementedError

    def columns(self, table, keys: list) -> dict:
        """`{name: values for keys}` of the per-key columns the table holds beside its rows and checkpoints with
        them (optimizer slots, counters); empty for a kind that keeps none."""
        return {}

    def variables(self, table) -> list:
        """The variables an optimizer trains."""
        return list(table.held_variables)

    def plain(self):
        """A plain single-device object a checkpoint of a table restores into (its rows by key: `numpy()[key]`),
        None for a kind whose checkpoints only its own tables read."""
        return None


class FixedAdapter(KindAdapter):
    """Rows `[0, n)` made from given values: every row is live from the start."""

    kind = "fixed"
    rows, dim = 29, 3
    layout = {"partitions": 3, "scheme": "balanced"}
    layouts = tuple({"partitions": p, "scheme": s} for p, s in ((1, "div"), (2, "mod"), (5, "div"), (4, "balanced")))

    def values(self):
        return table_values(self.rows, self.dim)

    def make(self, strategy, name, option, **layout):
        return strategy.create_sharded_variable(
            name, [self.rows, self.dim], initializer=self.values(), placement=option, **layout
        )

    def keys(self, rng, n):
        return rng.integers(0, self.rows, size=n).astype(np.int64)

    def initial(self, table, keys):
        return self.values()[np.asarray(keys, np.int64)]

    def live_keys(self, table):
        return list(range(self.rows))

    def read(self, table, keys):
        return table.numpy()[np.asarray(keys, np.int64)]

    def plain(self):
        return tf.Variable(tf.zeros([self.rows, self.dim]))


class DynamicAdapter(KindAdapter):
    """Raw int64 keys (negative ones and ones beyond 2**53 included): a key gets its row when a training lookup
    first meets it, initialised from (seed, key). Its optimizer's slots are columns of the table, beside the
    keys' last-seen step and hit count."""

    kind = "dynamic"
    dim, seed = 3, 11
    layout = {"partitions": 2}
    layouts = ({"partitions": 1}, {"partitions": 3})
    key_dtype = tf.int64

    def make(self, strategy, name, option, **layout):
        return strategy.create_dynamic_table(
            name, self.dim, key_dtype=self.key_dtype, seed=self.seed, placement=option, **layout
        )

    def keys(self, rng, n):
        pool = rng.integers(-(2**62), 2**62, size=24, dtype=np.int64)
        pool[:3] = [-1, 0, 2**53 + 1]
        return pool[np.minimum(rng.zipf(1.5, size=n) - 1, len(pool) - 1)]

    def initial(self, table, keys):
        return table.initial_rows(tf.constant(keys, self.key_dtype)).numpy()

    def live_keys(self, table):
        keys = table.export()[0].numpy().tolist()
        if len(keys) != int(table.size()):
            raise AssertionError(f"{len(keys)} keys exported, size() says {int(table.size())}")
        return keys

    def read(self, table, keys):
        rows = dict(zip(*[t.numpy().tolist() for t in table.export()]))
        return np.array([rows[k] for k in keys], np.float32)

    def columns(self, table, keys):
        names = (*table.slot_columns, "seen", "hits")
        exported, _, columns = table.export_columns(names)
        where = {k: i for i, k in enumerate(exported.numpy().tolist())}
        at = np.array([where[k] for k in keys], np.int64)
        return {name: columns[name].numpy()[at] for name in names}


class StringDynamicAdapter(DynamicAdapter):
    """Dynamic tables keyed by strings (empty, non-ASCII and long ones included)."""

    key_dtype = tf.string

    def keys(self, rng, n):
        pool = np.array([b"", "\u00e9t\u00e9".encode(), b"x" * 300] + [f"user-{i}".encode() for i in range(21)])
        return pool[np.minimum(rng.zipf(1.5, size=n) - 1, len(pool) - 1)]


class ConstantAdapter(KindAdapter):
    """`tests/conformance/minimal_kind.py`: rows `[id, -id]` computed by its lookup, nothing stored."""

    kind = minimal_kind.CONSTANT.name
    trains = False

    def live_keys(self, table):
        return []

    def make(self, strategy, name, option, **layout):
        return minimal_kind.ConstantRows()

    def keys(self, rng, n):
        return rng.integers(0, 100, size=n).astype(np.int64)

    def initial(self, table, keys):
        keys = np.asarray(keys, np.float32)
        return np.stack([keys, -keys], -1)


ADAPTERS = {
    "fixed": FixedAdapter(),
    "dynamic": DynamicAdapter(),
    "dynamic_string": StringDynamicAdapter(),
    minimal_kind.CONSTANT.name: ConstantAdapter(),
}
