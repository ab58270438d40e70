"""Typed configuration: the allowed values of every policy argument, and validated table and feature configs.

Every argument that takes one of a fixed set of strings is an enum here, and
every place that accepts such an argument validates it through the enum's
`parse`, so one mistake gets one error type and one message wherever it is
made. The enums are `str` subclasses: `Scheme.MOD == "mod"`, and the plain
strings stay accepted everywhere.

`TableConfig` is one validated `create_sharded_variable` call (what a strategy
hook receives); `FeatureConfig` is one feature of an `EmbeddingCollection`.
Both are frozen: a hook that needs another value makes a copy with
`dataclasses.replace`, so a caller's config never changes underneath it.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_sharded.errors import positive_int


class _Choice(str, enum.Enum):
    """A string enum whose members print as their value."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def values(cls) -> Tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value: Any, arg: str, optional: bool = False) -> str:
        """`value` as the plain string of one of the members, or ValueError naming `arg`."""
        if isinstance(value, str) and value in cls.values():
            return str(value)
        allowed = f"None or one of {cls.values()}" if optional else f"one of {cls.values()}"
        raise ValueError(f"Argument `{arg}` must be {allowed}. Received: {arg}={value!r}")

    @classmethod
    def parse_optional(cls, value: Any, arg: str, say_none: bool = False) -> Optional[str]:
        """`parse`, with None allowed (and returned); `say_none`: the error lists None too (where None is a mode)."""
        return None if value is None else cls.parse(value, arg, optional=say_none)


class Scheme(_Choice):
    """How rows are assigned to shards (see `tfs.PartitionSpec`).

    Example:

    >>> import tf_sharded as tfs
    >>> tfs.Scheme.MOD == "mod", tfs.Scheme.values()
    (True, ('div', 'mod', 'balanced'))
    """

    DIV = "div"
    MOD = "mod"
    BALANCED = "balanced"


class Exchange(_Choice):
    """How a mirrored table's sparse gradients are summed across replicas (see `tfs.exchange`).

    Example:

    >>> import tf_sharded as tfs
    >>> tfs.Exchange.parse("dense", "exchange")
    'dense'
    """

    AUTO = "auto"
    ALLGATHER = "allgather"
    DENSE = "dense"


class Placement(_Choice):
    """Where a mirrored table lives: a copy per replica device, one per worker's host, or chosen by size.

    Example:

    >>> import tf_sharded as tfs
    >>> tfs.Placement.values()
    ('auto', 'device', 'host')
    """

    AUTO = "auto"
    DEVICE = "device"
    HOST = "host"


class Combiner(_Choice):
    """How the rows of one example's multi-hot ids are combined.

    Example:

    >>> import tf_sharded as tfs
    >>> tfs.Combiner.parse("avg", "combiner")
    Traceback (most recent call last):
    ...
    ValueError: Argument `combiner` must be one of ('sum', 'mean', 'sqrtn'). Received: combiner='avg'
    """

    SUM = "sum"
    MEAN = "mean"
    SQRTN = "sqrtn"


def optional_positive_int(name: str, value: Any) -> Optional[int]:
    """None, or `value` as a positive int; ValueError naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"Argument `{name}` must be a positive int or None. Received: {name}={value!r} "
            f"(of type {type(value).__name__})"
        )
    return int(value)


def _shape(shape: Any) -> Tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in tf.TensorShape(shape).as_list())
    except (TypeError, ValueError) as e:
        raise ValueError(f"Argument `shape` must be a fully defined shape. Received: shape={shape!r}") from e
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"Argument `shape` must have rank >= 1 and positive dimensions. Received: shape={shape!r}")
    return dims


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """A validated description of one sharded table: the arguments of `create_sharded_variable`.

    Constructing one validates every field (the error names the argument);
    `shape` is normalised to a tuple of ints and `dtype` to a `tf.DType`.

    Example:

    >>> from tf_sharded.config import TableConfig
    >>> TableConfig("items", [1000, 8], scheme="mod").shape
    (1000, 8)
    >>> TableConfig("items", [1000, 8], scheme="modulo")
    Traceback (most recent call last):
    ...
    ValueError: Argument `scheme` must be one of ('div', 'mod', 'balanced'). Received: scheme='modulo'
    """

    name: str
    shape: Tuple[int, ...]
    dtype: Any = tf.float32
    initializer: Any = "uniform"
    partitions: Any = None
    trainable: bool = True
    scheme: Optional[str] = None
    seed: Optional[int] = None
    exchange: Optional[str] = None
    placement: Optional[str] = None
    ids_per_step: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Argument `name` must be a non-empty string. Received: name={self.name!r}")
        set_ = lambda field, value: object.__setattr__(self, field, value)  # noqa: E731  (frozen)
        set_("shape", _shape(self.shape))
        try:
            set_("dtype", tf.as_dtype(self.dtype))
        except TypeError as e:
            raise TypeError(f"Argument `dtype` must be a TensorFlow dtype. Received: dtype={self.dtype!r}") from e
        if not isinstance(self.trainable, bool):
            raise TypeError(f"Argument `trainable` must be a bool. Received: trainable={self.trainable!r}")
        set_("scheme", Scheme.parse_optional(self.scheme, "scheme"))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise TypeError(f"Argument `seed` must be an int or None. Received: seed={self.seed!r}")
        set_("exchange", Exchange.parse_optional(self.exchange, "exchange"))
        set_("placement", Placement.parse_optional(self.placement, "placement"))
        set_("ids_per_step", optional_positive_int("ids_per_step", self.ids_per_step))

    @property
    def mirrored_only(self) -> dict:
        """The arguments that only mean something under mirrored strategies, where they are not neutral."""
        values = {"exchange": self.exchange, "placement": self.placement, "ids_per_step": self.ids_per_step}
        return {k: v for k, v in values.items() if v not in (None, "auto")}

    # The per-table dict of `tfs.layers.EmbeddingCollection(tables=...)`.
    LAYER_KEYS = ("input_dim", "output_dim", "embeddings_initializer", "partitions", "scheme", "exchange",
                  "placement", "seed")  # fmt: skip

    @classmethod
    def from_layer_config(cls, name: str, config: Any):
        """A table from an `EmbeddingCollection` table dict (`input_dim`, `output_dim`, ...), validated.

        A dict with `"vocabulary": "dynamic"` gives a `DynamicTableConfig`.
        """
        if isinstance(config, (TableConfig, DynamicTableConfig)):
            return config
        arg = f"tables['{name}']"
        if isinstance(config, dict) and config.get("vocabulary", "static") != "static":
            if config["vocabulary"] != "dynamic":
                raise ValueError(
                    f"Argument `{arg}['vocabulary']` must be 'static' (ids in [0, input_dim)) or 'dynamic' (raw "
                    f"keys). Received: {config['vocabulary']!r}"
                )
            return DynamicTableConfig.from_layer_config(name, config)
        if isinstance(config, dict):
            config = {k: v for k, v in config.items() if k != "vocabulary"}
        if not isinstance(config, dict) or "input_dim" not in config or "output_dim" not in config:
            raise ValueError(f"Argument `{arg}` must be a dict with 'input_dim' and 'output_dim'. Received: {config!r}")
        unknown = sorted(set(config) - set(cls.LAYER_KEYS))
        if unknown:
            raise ValueError(f"Argument `{arg}` has unknown keys {unknown}; allowed: {cls.LAYER_KEYS}")
        rows = positive_int(f"{arg}['input_dim']", config["input_dim"])
        dim = positive_int(f"{arg}['output_dim']", config["output_dim"])
        options = {k: config[k] for k in ("partitions", "scheme", "exchange", "placement", "seed") if k in config}
        return cls(name, (rows, dim), initializer=config.get("embeddings_initializer", "uniform"), **options)

    def to_layer_config(self) -> dict:
        """The `EmbeddingCollection` table dict of this config (fields left at their defaults omitted)."""
        config = {"input_dim": self.shape[0], "output_dim": self.shape[1]}
        if not (isinstance(self.initializer, str) and self.initializer == "uniform"):
            config["embeddings_initializer"] = self.initializer
        for key in ("partitions", "scheme", "exchange", "placement", "seed"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        return config


@dataclasses.dataclass(frozen=True)
class DynamicTableConfig:
    """A dynamic table of an `EmbeddingCollection` (`"vocabulary": "dynamic"`): `create_dynamic_table`'s arguments.

    Example:

    >>> from tf_sharded.config import DynamicTableConfig
    >>> DynamicTableConfig.from_layer_config("users", {"vocabulary": "dynamic", "output_dim": 8}).shape
    (None, 8)
    """

    name: str
    dim: int
    key_dtype: str = "int64"
    initializer: Any = "uniform"
    partitions: Optional[int] = None
    seed: Optional[int] = None
    admission: Any = None
    eviction: Any = None
    max_rows: Optional[int] = None

    LAYER_KEYS = ("vocabulary", "output_dim", "key_dtype", "embeddings_initializer", "partitions", "seed",
                  "admission", "eviction", "max_rows")  # fmt: skip

    def __post_init__(self):
        object.__setattr__(self, "dim", positive_int("output_dim", self.dim))
        if self.key_dtype not in ("int64", "string"):
            raise TypeError(f"Argument `key_dtype` must be 'int64' or 'string'. Received: key_dtype={self.key_dtype!r}")
        object.__setattr__(self, "partitions", optional_positive_int("partitions", self.partitions))
        object.__setattr__(self, "max_rows", optional_positive_int("max_rows", self.max_rows))

    @property
    def shape(self) -> Tuple[Optional[int], int]:
        return (None, self.dim)

    @classmethod
    def from_layer_config(cls, name: str, config: dict) -> DynamicTableConfig:
        arg = f"tables['{name}']"
        unknown = sorted(set(config) - set(cls.LAYER_KEYS))
        if unknown:
            raise ValueError(
                f"Argument `{arg}` has unknown keys {unknown} for a dynamic table; allowed: {cls.LAYER_KEYS}"
            )
        if "output_dim" not in config:
            raise ValueError(f"Argument `{arg}` must have 'output_dim'. Received: {config!r}")
        options = {k: config[k] for k in ("key_dtype", "partitions", "seed", "admission", "eviction", "max_rows")
                   if k in config}  # fmt: skip
        try:
            initializer = config.get("embeddings_initializer", "uniform")
            return cls(name, config["output_dim"], initializer=initializer, **options)
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace("Argument `", f"Argument `{arg}['", 1).replace("` ", "']` ", 1)) from None

    def to_layer_config(self) -> dict:
        config = {"vocabulary": "dynamic", "output_dim": self.dim, "key_dtype": self.key_dtype}
        if not (isinstance(self.initializer, str) and self.initializer == "uniform"):
            config["embeddings_initializer"] = self.initializer
        for key in ("partitions", "seed", "admission", "eviction", "max_rows"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        return config


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """One input feature of an `EmbeddingCollection`: the table it reads and how multi-hot ids combine.

    Example:

    >>> import tf_sharded as tfs
    >>> tfs.FeatureConfig("items", combiner="mean")
    FeatureConfig(table='items', combiner='mean')
    """

    table: str
    combiner: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.table, str) or not self.table:
            raise ValueError(f"Argument `table` must be a table name. Received: table={self.table!r}")
        object.__setattr__(self, "combiner", Combiner.parse_optional(self.combiner, "combiner", say_none=True))

    @classmethod
    def parse(cls, feature: str, spec: Any, tables) -> FeatureConfig:
        """A feature from `"table"`, `{"table": ..., "combiner": ...}` or a FeatureConfig; its table must exist."""
        arg = f"features['{feature}']"
        if isinstance(spec, str):
            spec = {"table": spec}
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - {"table", "combiner"})
            if unknown:
                raise ValueError(f"Argument `{arg}` has unknown keys {unknown}; allowed: ['combiner', 'table']")
            if spec.get("table") not in tables:
                raise ValueError(
                    f"Argument `{arg}` must name one of the tables {sorted(tables)}. Received: {spec.get('table')!r}"
                )
            try:
                return cls(spec["table"], spec.get("combiner"))
            except ValueError as e:
                raise ValueError(str(e).replace("Argument `combiner`", f"Argument `{arg}['combiner']`")) from None
        if isinstance(spec, FeatureConfig):
            if spec.table not in tables:
                raise ValueError(
                    f"Argument `{arg}` must name one of the tables {sorted(tables)}. Received: {spec.table!r}"
                )
            return spec
        raise ValueError(f"Argument `{arg}` must be a table name, a dict or a tfs.FeatureConfig. Received: {spec!r}")

    def to_config(self) -> dict:
        return {"table": self.table, "combiner": self.combiner}
