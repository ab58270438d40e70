"""What a training process holds in memory: its peak resident size, the variables it holds, and the tables' size.

The application prints it after training (the `memory:` line), so that the
memory a strategy saves on a worker is read from the run itself:

* peak resident memory of this process (`getrusage`);
* the bytes of the model's and optimizer's variables held by this process:
  each replica's copy of a mirrored variable counts, a variable on a
  parameter server or a table on table servers does not;
* the bytes of the model's tables and their optimizer slots, wherever they
  are (static tables: rows x width x item size x (1 + slots per row)).
"""

from __future__ import annotations

import re
import resource
from typing import Dict, Iterable, Optional

import tensorflow as tf

from tf_sharded import _compat
from tf_sharded.table.protocol import owner_of

MIB = float(1 << 20)


def _components(variable) -> Iterable:
    """The `tf.Variable`s behind a Keras or distributed variable (each replica's copy of a mirrored one)."""
    value = _compat.keras_variable_value(variable)
    value = variable if value is None else value
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def held_bytes(variables) -> int:
    """Bytes of the `variables` whose storage is in this process (not on a `ps` task), each copy counted once."""
    seen, total = set(), 0
    for variable in variables:
        for part in _components(variable):
            if id(part) in seen or not isinstance(part, tf.Variable):
                continue
            seen.add(id(part))
            if "/job:ps" in (part.device or "") or part.shape.num_elements() is None:
                continue
            total += part.shape.num_elements() * part.dtype.size
    return total


def _tables(model) -> list:
    tables = {}
    for variable in model.variables:
        tag = owner_of(variable)
        if tag is not None:
            tables[id(tag[0])] = tag[0]
    return list(tables.values())


def _slot_names(optimizer) -> list:
    return optimizer.slot_names() if hasattr(optimizer, "slot_names") else []


def table_bytes(model) -> int:
    """Bytes of the model's static tables and their optimizer slots, wherever they live."""
    slots = len(_slot_names(getattr(model, "optimizer", None)))
    total = 0
    for table in _tables(model):
        shape = tf.TensorShape(table.shape)
        if shape.is_fully_defined():
            total += shape.num_elements() * tf.as_dtype(table.dtype).size * (1 + slots)
    return total


def footprint(model) -> Dict[str, float]:
    """Peak resident MiB of this process, MiB of variables it holds, MiB of the tables and their slots."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables) + (list(optimizer.variables) if optimizer is not None else [])
    for table in _tables(model):  # tf_sharded's table slots are tables of their own, not Keras variables
        for name in _slot_names(optimizer):
            try:
                slot = optimizer.table_slot(table, name)
            except ValueError:  # a table the optimizer does not train
                continue
            variables += list(getattr(slot, "variables", ()))
    return {
        "peak_resident_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "held_mib": held_bytes(variables) / MIB,
        "tables_mib": table_bytes(model) / MIB,
    }


def describe(found: Dict[str, float]) -> str:
    """The `memory:` line the application prints."""
    return (
        f"memory: peak resident {found['peak_resident_mib']:,.0f} MiB; variables held here "
        f"{found['held_mib']:,.1f} MiB; tables and their optimizer slots {found['tables_mib']:,.1f} MiB"
    )


_LINE = re.compile(
    r"^memory: peak resident ([\d,]+) MiB; variables held here ([\d,.]+) MiB; tables and their optimizer slots "
    r"([\d,.]+) MiB$",
    re.M,
)


def parse(output: str) -> Optional[Dict[str, float]]:
    """The figures of the first `memory:` line in a command's output (as `describe` wrote them), or None."""
    found = _LINE.search(output)
    if found is None:
        return None
    keys = ("peak_resident_mib", "held_mib", "tables_mib")
    return {key: float(value.replace(",", "")) for key, value in zip(keys, found.groups())}
