"""Sparse-aware Keras 3 optimizers: lazy row updates on the shard that owns the row.

`tfs.optimizers.SGD`, `Adagrad`, `Adam` and `Ftrl` are the Keras 3 optimizers
of the same names (same arguments, same dense behaviour) with one difference:
for a shard of a `tfs.ShardedVariable` table,

* the gradient's rows are summed per id, then only those rows of the shard
  and of its slots are read, updated and written back (scatter), on the
  shard's own device. Rows a step does not touch, and their slots, stay
  bit-identical ("lazy" updates; Keras 3's own Adam densifies instead);
* slots (momentum, accumulators, ...) are themselves `ShardedVariable`s with
  the table's layout, shard `i` beside shard `i`. They are checkpointed as
  full-shape entries like any table, so optimizer state restores into
  another number of shards, scheme or strategy together with its table.

Weight decay reaches a table's touched rows only. `use_ema` and
`gradient_accumulation_steps` would update whole tables every step and are
refused for optimizers that see a sharded table.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import keras
import tensorflow as tf

from tf_sharded import _compat, trace
from tf_sharded.table.batched import logical_tables, members_of, slot_views
from tf_sharded.table.protocol import Table, owner_of, update_exclusively
from tf_sharded.table.registry import placement_of


def _beside(slot_shard, variable):
    """The copy of `slot_shard` on `variable`'s device (mirrored slots have one per replica)."""
    if not isinstance(slot_shard, tf.distribute.DistributedValues):
        return slot_shard
    for component in slot_shard.values:
        if component.device == variable.device:
            return component
    return slot_shard.values[0]


def _touched(gradient, dtype, unique_rows: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
    """(distinct local rows, summed gradient rows) of a shard's gradient.

    A dense gradient (a densified exchange) is reduced to its non-zero rows,
    so that every exchange mode gives the same lazy update. `unique_rows`:
    the caller knows the indices hold each row once (no merge needed).
    """
    if isinstance(gradient, tf.IndexedSlices) and unique_rows:
        return tf.cast(gradient.indices, tf.int64), tf.cast(gradient.values, dtype)
    if isinstance(gradient, tf.IndexedSlices):
        unique, position = tf.unique(tf.cast(gradient.indices, tf.int64), out_idx=tf.int32)
        summed = tf.math.unsorted_segment_sum(gradient.values, position, tf.size(unique))
        return unique, tf.cast(summed, dtype)
    gradient = tf.convert_to_tensor(gradient)
    inner = list(range(1, gradient.shape.rank))
    nonzero = tf.not_equal(gradient, 0)
    rows = tf.where(tf.reduce_any(nonzero, axis=inner) if inner else nonzero)[:, 0]
    return rows, tf.cast(tf.gather(gradient, rows), dtype)


def _builds_slots(optimizer) -> bool:
    """Whether a Keras optimizer keeps per-variable slots (all but plain SGD)."""
    return not (isinstance(optimizer, keras.optimizers.SGD) and not optimizer.momentum)


def check_trains_tables(optimizer, variables) -> None:
    """Refuses an optimizer that cannot train a table among `variables`, naming the table.

    Keras's own optimizers build each slot with the shape its variable has
    when they are built; a dynamic table's row pools grow afterwards. And
    they build a slot beside each variable through the strategy, which under
    a mirrored strategy refuses the single plain variable of a host-placed
    or sharded table's shard.
    """
    if isinstance(optimizer, _TableSlots):
        return
    for variable in variables:
        tag = owner_of(variable)
        placement = placement_of(tag[0]) if tag is not None else None
        if placement is not None and placement.single_copy and _builds_slots(optimizer):
            raise ValueError(
                f"Table '{tag[0].name}' (placement='{tag[0].placement}') needs a tfs.optimizers optimizer: Keras's "
                f"own build their slots as copies on every replica, which its single-copy shards cannot have. "
                f"Received: optimizer={type(optimizer).__module__}.{type(optimizer).__name__}. Use tfs.optimizers."
                f"{type(optimizer).__name__} with the same arguments (Keras's SGD without momentum also works)."
            )
        if tag is not None and not tag[0].kind.static_rows:
            tables = logical_tables(tag[0])  # the tables sharing row pools, where they do
            names, many = ", ".join(f"'{t.name}'" for t in tables), len(tables) > 1
            raise ValueError(
                f"Dynamic table{'s' if many else ''} {names} need{'' if many else 's'} a tfs.optimizers optimizer "
                f"({'their' if many else 'its'} rows are added as keys arrive; Keras's own optimizers size their "
                f"slots once). Received: optimizer="
                f"{type(optimizer).__module__}.{type(optimizer).__name__}. Use tfs.optimizers."
                f"{type(optimizer).__name__} with the same arguments."
            )


def _gradient_tensors(grads) -> list:
    if tf.executing_eagerly():
        return []  # eager ops run in order: a failed gradient raised before the update began
    out = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            out += [g.values, g.indices]
        elif g is not None:
            out.append(g)
    return out


class _TableSlots(_compat.KerasOptimizerHooks):
    """Mixin placed before a Keras optimizer: sharded slots and lazy row updates for tables.

    Subclasses list their slots in `_table_slot_fills()` and implement
    `_update_rows(variable, rows, grad, slots, lr)`.
    """

    def _table_slot_fills(self) -> List[Tuple[str, float]]:
        return []

    @property
    def _linear(self) -> bool:
        """Whether the update is `-lr * gradient` (so duplicate rows can be left to the scatter)."""
        return False

    def _update_rows(self, variable, rows, grad, slots: Dict[str, tf.Variable], lr):
        raise NotImplementedError

    # -------------------------------------------------------------- building --

    def build(self, variables):
        if self.built:
            return
        variables = list(variables)
        tables: List[Table] = []
        dense = []
        for v in variables:
            tag = owner_of(v)
            if tag is None:
                dense.append(v)
            elif not any(t is tag[0] for t in tables):
                tables.append(tag[0])
        if tables and (self.use_ema or self.gradient_accumulation_steps):
            option = "use_ema" if self.use_ema else "gradient_accumulation_steps"
            raise ValueError(
                f"Argument `{option}` of {type(self).__name__} is not supported with sharded tables: it would "
                f"update every row of table '{tables[0].name}' each step. Received: {option}="
                f"{getattr(self, option)!r}. Please drop it, or keep the tables in a separate optimizer."
            )
        # Keras builds its own slots for the dense variables, indexed by their
        # position in `dense`; table shards are registered after them (so that
        # Keras accepts their gradients) and no Keras slot list reaches them.
        super().build(dense)
        decayed = set()  # (id(table), shard) of the shards weight decay applies to, exclusions honoured
        for v in variables:
            tag = owner_of(v)
            if tag is not None:
                _compat.keras_register_trainable(self, v)
                if self.weight_decay is not None and _compat.keras_uses_weight_decay(self, v):
                    decayed.add((id(tag[0]), tag[1]))
        # Not tracked: the shards are checkpointed by their table, and slots by name below.
        _compat.set_untracked(self, "_tfs_variables", variables)
        _compat.set_untracked(self, "_tfs_slots", {})
        logical = []  # the tables as the user sees them: a batched storage's members in its place
        _compat.set_untracked(self, "_tfs_tables", logical)
        _compat.set_untracked(self, "_tfs_decayed", decayed)
        for table in tables:
            # Where rows are trained remotely (table servers), the optimizer tells them how: the slots made here
            # are then views of theirs.
            table.placement_type.attach_optimizer(self, table)
            slots = {slot: table.make_slot(f"{table.name}/{slot}", fill) for slot, fill in self._table_slot_fills()}
            self._tfs_slots[id(table)] = slots
            members = members_of(table)
            if members is not None:  # the storage's slots are checkpointed as one view per member table
                views = {slot: slot_views(table, value, slot) for slot, value in slots.items()}
                for i, member in enumerate(members):
                    self._tfs_slots[id(member)] = {slot: views[slot][i] for slot in slots}
            elif hasattr(table, "member_slots"):  # dynamic tables sharing pools: each saves its own columns
                members = table.members
                for member, views in zip(members, table.member_slots(slots)):
                    self._tfs_slots[id(member)] = views
            for member in members or [table]:
                for slot, value in self._tfs_slots[id(member)].items():
                    # Keyed by the table's position, as Keras keys its own slots.
                    _compat.keras_track(self, value, f"table_slots_{len(logical)}_{slot}")
                logical.append(member)
        self.built = True

    def slot_names(self) -> List[str]:
        """The names of the slots this optimizer keeps per table row (e.g. `["accumulator"]`)."""
        return [name for name, _ in self._table_slot_fills()]

    def table_slot(self, table: Table, name: str) -> Table:
        """The slot `name` (e.g. "momentum") of `table`, a `ShardedVariable` with the table's layout.

        Raises:
          ValueError: the optimizer was not built with `table`, or has no such slot.
        """
        slots = getattr(self, "_tfs_slots", {}).get(id(table))
        if slots is None:
            raise ValueError(f"Argument `table` must be a table this optimizer was built with. Received: {table!r}")
        if name not in slots:
            raise ValueError(f"Argument `name` must be one of {sorted(slots)}. Received: name={name!r}")
        return slots[name]

    def save_own_variables(self, store):
        super().save_own_variables(store)
        for k, table in enumerate(getattr(self, "_tfs_tables", [])):
            for name, slot in self._tfs_slots[id(table)].items():
                if hasattr(slot, "save_to"):  # a dynamic table's slot: values by key
                    slot.save_to(store, f"table_slots_{k}_{name}")
                else:
                    store[f"table_slots_{k}_{name}"] = slot.numpy()

    def load_own_variables(self, store):
        ours = [key for key in store.keys() if key.startswith("table_slots_")]
        super().load_own_variables({key: store[key] for key in store.keys() if key not in ours})
        for k, table in enumerate(getattr(self, "_tfs_tables", [])):
            for name, slot in self._tfs_slots[id(table)].items():
                key = f"table_slots_{k}_{name}"
                if key in ours and hasattr(slot, "load_from"):
                    slot.load_from(store, key)
                elif key in ours:
                    slot.assign(store[key][...])

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None and getattr(self, "_tfs_variables", None) is not None:
            trainable_variables = self._tfs_variables
        # Keras increments `iterations` with nothing tying it to the step: in a traced step whose lookup or
        # gradient fails, the increment still runs and a step that applied nothing is counted. Every op of
        # the update, the increment included, waits for every gradient here. The increment is one op where
        # `iterations` lives (under parameter servers Keras's read, add and assign cross to its ps and back).
        if not self.built and trainable_variables is not None:
            # Built before the update waits for the gradients: slots made inside that block would carry the
            # step's gradients as control inputs of their initializers, which the first traced step cannot lift.
            self.build(trainable_variables)
        _compat.set_untracked(self, "_tfs_rates", {})
        try:
            with tf.control_dependencies(_gradient_tensors(grads)), _compat.increment_in_place(self.iterations):
                return super().apply(grads, trainable_variables)
        finally:
            _compat.set_untracked(self, "_tfs_rates", None)

    def dense_decay_variables(self, variables):
        # A table's decay is applied to its touched rows in `update_step`.
        return [v for v in variables if owner_of(v) is None]

    # -------------------------------------------------------------- updating --

    def update_step(self, gradient, variable, learning_rate):
        tag = owner_of(variable)
        if tag is None:
            return super().update_step(gradient, variable, learning_rate)
        table, shard = tag
        slots = {name: _beside(t.variables[shard], variable) for name, t in self._tfs_slots[id(table)].items()}
        lr = self._learning_rate_on(variable, learning_rate)
        decay = self._decays(variable)
        with tf.device(variable.device):
            if self._linear and not decay and isinstance(gradient, tf.IndexedSlices):
                # A scatter sums duplicate rows itself: no merge needed.
                values = tf.cast(gradient.values, variable.dtype) * lr
                update_exclusively(
                    table, shard, lambda: variable.scatter_sub(tf.IndexedSlices(values, gradient.indices))
                )
                return
            rows, grad = _touched(gradient, variable.dtype, unique_rows=trace.single_lookup(table))

            def write():
                if decay:
                    wd = tf.cast(self.weight_decay, variable.dtype)
                    variable.scatter_sub(tf.IndexedSlices(tf.gather(variable, rows) * wd * lr, rows))
                self._update_rows(variable, rows, grad, slots, lr)

            update_exclusively(table, shard, write)

    def _learning_rate_on(self, variable, learning_rate) -> tf.Tensor:
        """The learning rate as `variable`'s dtype on its device, read once per step and device (not once per
        shard: each read of the rate's variable is a transfer from where it lives)."""
        cache = getattr(self, "_tfs_rates", None)
        if tf.executing_eagerly() or cache is None:
            return tf.cast(learning_rate, variable.dtype)
        key = (id(learning_rate), variable.device, variable.dtype)  # the cache lives for one `apply`
        if key not in cache:
            with tf.device(variable.device):
                cache[key] = tf.cast(learning_rate, variable.dtype)
        return cache[key]

    def _decays(self, variable) -> bool:
        """Whether weight decay applies to a shard (recorded at build; a mirrored copy counts as its shard)."""
        table, shard = owner_of(variable)
        return self.weight_decay is not None and (id(table), shard) in self._tfs_decayed

    @staticmethod
    def _write(variable, rows, values):
        variable.scatter_update(tf.IndexedSlices(values, rows))


@keras.saving.register_keras_serializable(package="tf_sharded")
class SGD(_TableSlots, keras.optimizers.SGD):
    """`keras.optimizers.SGD` with lazy, per-shard row updates of sharded tables.

    Without momentum a table's rows are updated with one scatter; with
    momentum, only touched rows' momentum changes.

    Example:

    >>> import tf_sharded as tfs
    >>> table = tfs.create_sharded_variable("sgd_doc", [4, 1], initializer="zeros", partitions=2)
    >>> opt = tfs.optimizers.SGD(learning_rate=0.5)
    >>> g = tf.IndexedSlices(tf.constant([[1.0], [1.0]]), tf.constant([1, 1], tf.int64), tf.constant([2, 1]))
    >>> _ = opt.apply_gradients([(g, table.variables[0])])
    >>> table.numpy().ravel().tolist()
    [0.0, -1.0, 0.0, 0.0]
    """

    def _table_slot_fills(self):
        return [("momentum", 0.0)] if self.momentum != 0 else []

    @property
    def _linear(self) -> bool:
        return self.momentum == 0

    def _update_rows(self, variable, rows, grad, slots, lr):
        if self.momentum == 0:
            variable.scatter_sub(tf.IndexedSlices(grad * lr, rows))
            return
        mom = tf.cast(self.momentum, variable.dtype)
        m = tf.gather(slots["momentum"], rows) * mom - grad * lr
        self._write(slots["momentum"], rows, m)
        step = m * mom - grad * lr if self.nesterov else m
        variable.scatter_add(tf.IndexedSlices(step, rows))


@keras.saving.register_keras_serializable(package="tf_sharded")
class Adagrad(_TableSlots, keras.optimizers.Adagrad):
    """`keras.optimizers.Adagrad` with lazy, per-shard row updates of sharded tables.

    Example:

    >>> import tf_sharded as tfs
    >>> table = tfs.create_sharded_variable("adagrad_doc", [3, 1], initializer="zeros")
    >>> opt = tfs.optimizers.Adagrad(learning_rate=1.0, initial_accumulator_value=0.0, epsilon=0.0)
    >>> g = tf.IndexedSlices(tf.constant([[2.0]]), tf.constant([2], tf.int64), tf.constant([3, 1]))
    >>> _ = opt.apply_gradients([(g, table.variables[0])])
    >>> table.numpy().ravel().tolist(), opt.table_slot(table, "accumulator").numpy().ravel().tolist()
    ([0.0, 0.0, -1.0], [0.0, 0.0, 4.0])
    """

    def _table_slot_fills(self):
        return [("accumulator", float(self.initial_accumulator_value))]

    def _update_rows(self, variable, rows, grad, slots, lr):
        acc = tf.gather(slots["accumulator"], rows) + tf.square(grad)
        self._write(slots["accumulator"], rows, acc)
        variable.scatter_sub(tf.IndexedSlices(lr * grad / tf.sqrt(acc + self.epsilon), rows))


@keras.saving.register_keras_serializable(package="tf_sharded")
class Adam(_TableSlots, keras.optimizers.Adam):
    """Lazy Adam: `keras.optimizers.Adam`, but a table's untouched rows and moments stay as they are.

    Keras 3's Adam densifies a sparse gradient and decays every row's moments
    each step; here only the rows a step looks up change (the bias
    correction still follows the optimizer's step count).

    Example:

    >>> import tf_sharded as tfs
    >>> table = tfs.create_sharded_variable("adam_doc", [3, 1], initializer="zeros", partitions=3)
    >>> opt = tfs.optimizers.Adam(learning_rate=0.1)
    >>> g = tf.IndexedSlices(tf.constant([[1.0]]), tf.constant([0], tf.int64), tf.constant([1, 1]))
    >>> _ = opt.apply_gradients([(g, v) for v in table.variables[:1]])
    >>> [round(float(x), 4) for x in table.numpy().ravel()]
    [-0.1, 0.0, 0.0]
    """

    def _table_slot_fills(self):
        fills = [("momentum", 0.0), ("velocity", 0.0)]
        return fills + ([("velocity_hat", 0.0)] if self.amsgrad else [])

    def _update_rows(self, variable, rows, grad, slots, lr):
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        m = tf.gather(slots["momentum"], rows)
        v = tf.gather(slots["velocity"], rows)
        m = m + (grad - m) * (1 - beta_1)
        v = v + (tf.square(grad) - v) * (1 - beta_2)
        self._write(slots["momentum"], rows, m)
        self._write(slots["velocity"], rows, v)
        if self.amsgrad:
            v = tf.maximum(tf.gather(slots["velocity_hat"], rows), v)
            self._write(slots["velocity_hat"], rows, v)
        variable.scatter_sub(tf.IndexedSlices(m * alpha / (tf.sqrt(v) + self.epsilon), rows))


@keras.saving.register_keras_serializable(package="tf_sharded")
class Ftrl(_TableSlots, keras.optimizers.Ftrl):
    """`keras.optimizers.Ftrl` with lazy, per-shard row updates of sharded tables.

    Example:

    >>> import tf_sharded as tfs
    >>> table = tfs.create_sharded_variable("ftrl_doc", [2, 1], initializer="zeros")
    >>> opt = tfs.optimizers.Ftrl(learning_rate=1.0, initial_accumulator_value=1.0)
    >>> g = tf.IndexedSlices(tf.constant([[1.0]]), tf.constant([1], tf.int64), tf.constant([2, 1]))
    >>> _ = opt.apply_gradients([(g, table.variables[0])])
    >>> [round(float(x), 4) for x in table.numpy().ravel()]
    [0.0, -0.7071]
    """

    def _table_slot_fills(self):
        return [("accumulator", float(self.initial_accumulator_value)), ("linear", 0.0)]

    def _update_rows(self, variable, rows, grad, slots, lr):
        lr_power = self.learning_rate_power
        l2 = self.l2_regularization_strength + self.beta / (2.0 * lr)
        l1 = self.l1_regularization_strength
        var = tf.gather(variable, rows)
        accum = tf.gather(slots["accumulator"], rows)
        linear = tf.gather(slots["linear"], rows)
        grad_to_use = grad + 2 * self.l2_shrinkage_regularization_strength * var
        new_accum = accum + tf.square(grad)
        linear = linear + grad_to_use - (tf.pow(new_accum, -lr_power) - tf.pow(accum, -lr_power)) / lr * var
        quadratic = tf.pow(new_accum, -lr_power) / lr + 2 * l2
        new_var = (tf.clip_by_value(linear, -l1, l1) - linear) / quadratic
        self._write(slots["linear"], rows, linear)
        self._write(slots["accumulator"], rows, new_accum)
        self._write(variable, rows, new_var)


def get(identifier: Optional[object]):
    """`tfs.optimizers.get("adam")` -> a tf_sharded optimizer (names as in Keras)."""
    names = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam, "ftrl": Ftrl}
    if isinstance(identifier, str) and identifier.lower() in names:
        return names[identifier.lower()]()
    raise ValueError(f"Argument `identifier` must be one of {sorted(names)}. Received: {identifier!r}")
