"""Typed configuration: the allowed values of every policy argument, and validated table and feature configs.

Every argument that takes one of a fixed set of strings is an enum here, and
every place that accepts such an argument validates it through the enum's
`parse`, so one mistake gets one error type and one message wherever it is
made. The enums are `str` subclasses that print, hash and serialise as
their value: `Scheme.MOD == "mod"`, and the plain strings stay accepted
everywhere.

The table configs are one family: `BaseTableConfig` holds what every table
has under one name each (`name`, `dim`, `dtype`, `initializer`,
`partitions`, `seed`, `exchange`, `placement`), validates it, and converts
to and from the table dicts of `tfs.layers.EmbeddingCollection` from each
kind's table of layer keys. `TableConfig` (a `[rows, dim]` table, one
validated `create_sharded_variable` call, what a strategy hook receives) and
`DynamicTableConfig` (raw keys, `create_dynamic_table`'s arguments) add
their own fields; `vocabulary` says which one a config is. `FeatureConfig`
is one feature of an `EmbeddingCollection`. All are frozen: a hook that
needs another value makes a copy with `dataclasses.replace`, so a caller's
config never changes underneath it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Any, ClassVar, Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_sharded.errors import positive_int


class _Choice(str, enum.Enum):
    """A string enum whose members print, compare, hash and serialise as their value."""

    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__  # configs and plans print as they did with plain strings

    @classmethod
    def values(cls) -> Tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def _allowed(cls, optional: bool) -> str:
        return f"None or one of {cls.values()}" if optional else f"one of {cls.values()}"

    @classmethod
    def parse(cls, value: Any, arg: str, optional: bool = False) -> _Choice:
        """`value` as one of the members, or ValueError naming `arg`."""
        if isinstance(value, str) and value in cls.values():
            return cls(value)
        raise ValueError(f"Argument `{arg}` must be {cls._allowed(optional)}. Received: {arg}={value!r}")

    @classmethod
    def parse_optional(cls, value: Any, arg: str, say_none: bool = False) -> Optional[_Choice]:
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
    """Where a table lives under a mirrored strategy: a copy per replica device, one per worker's host, or split
    along its rows over the replicas (`SHARDED`: replica `r` holds shard `r`); `AUTO` chooses by size.

    Example:

    >>> import tf_sharded as tfs
    >>> tfs.Placement.values()
    ('auto', 'device', 'host', 'sharded')
    """

    AUTO = "auto"
    DEVICE = "device"
    HOST = "host"
    SHARDED = "sharded"


class ExchangePolicy:
    """What a mirrored table does with its sparse gradients.

    Args:
      mode: "auto", "allgather" or "dense".
      ids_per_step: optional declared bound on the distinct ids one replica
        looks up in this table per step; "auto" then decides once, at trace
        time, instead of every step.

    Example:

    >>> ExchangePolicy("auto", ids_per_step=4096)
    ExchangePolicy(mode='auto', ids_per_step=4096)
    >>> ExchangePolicy("fast")
    Traceback (most recent call last):
    ...
    ValueError: Argument `exchange` must be one of ('auto', 'allgather', 'dense'). Received: exchange='fast'
    """

    def __init__(self, mode: str = "auto", ids_per_step: Optional[int] = None):
        self.mode = Exchange.parse(mode, "exchange")
        self.ids_per_step = optional_positive_int("ids_per_step", ids_per_step)

    def __repr__(self):
        return f"ExchangePolicy(mode={self.mode!r}, ids_per_step={self.ids_per_step})"


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


class Vocabulary(_Choice):
    """What a table's ids are: `STATIC`, rows of a fixed-size table (ids in `[0, rows)`, a `TableConfig`);
    `DYNAMIC`, raw int64 or string keys that get a row when training meets them (a `DynamicTableConfig`).

    Example:

    >>> from tf_sharded.config import DynamicTableConfig, Vocabulary
    >>> DynamicTableConfig("users", 8).vocabulary == Vocabulary.DYNAMIC
    True
    >>> Vocabulary.parse("open", "v")
    Traceback (most recent call last):
    ...
    ValueError: Argument `v` must be 'static' (ids in [0, input_dim)) or 'dynamic' (raw keys). Received: v='open'
    """

    STATIC = "static"
    DYNAMIC = "dynamic"

    @classmethod
    def _allowed(cls, optional: bool) -> str:
        return "'static' (ids in [0, input_dim)) or 'dynamic' (raw keys)"


class TopologyKind(_Choice):
    """The strategy family a `tfs.plan` is for (`Plan.kind`, the `kind` of its `strategy` dict).

    Example:

    >>> from tf_sharded.config import TopologyKind
    >>> TopologyKind.values()
    ('default', 'parameter_server', 'mirrored', 'multi_worker_mirrored')
    """

    DEFAULT = "default"
    PARAMETER_SERVER = "parameter_server"
    MIRRORED = "mirrored"
    MULTI_WORKER_MIRRORED = "multi_worker_mirrored"


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
class BaseTableConfig:
    """What every table config holds, validated: the base of `TableConfig` and `DynamicTableConfig`.

    Make one of the two kinds; `BaseTableConfig.from_layer_config` makes the
    kind a layer dict's `"vocabulary"` names. Both kinds convert to and from
    the table dicts of `tfs.layers.EmbeddingCollection` by one implementation,
    from a table of layer keys per kind (the keys every kind has, then each
    kind's own). The dicts keep Keras's key names (`input_dim`, `output_dim`,
    `embeddings_initializer`); the configs use the library's (`rows`, `dim`,
    `initializer`).

    Attributes:
      name: the table's name.
      dim: the row width (elements per row).
      dtype: the rows' dtype, a `tf.DType` (in a Keras layer, the layer's
        variable dtype instead).
      initializer: a Keras initializer name or object (or, for a
        `TableConfig`, a callable or a full-table array).
      partitions: None (the strategy's default) or the shards (for a
        `TableConfig`, an int, a `tfs.PartitionSpec` or a partitioner).
      seed: the initializer's seed (None: drawn from TensorFlow's global seed).
      exchange: mirrored strategies: how gradients are summed (`tfs.Exchange`).
      placement: mirrored strategies: where the copy lives (`tfs.Placement`).
      vocabulary: `Vocabulary.STATIC` or `Vocabulary.DYNAMIC` (a property).
      rows: the row count, None for a dynamic table (a property).

    Example:

    >>> from tf_sharded.config import BaseTableConfig, DynamicTableConfig, TableConfig
    >>> static = TableConfig("items", [1000, 8], seed=1)
    >>> dynamic = DynamicTableConfig("users", 8, seed=1)
    >>> [(c.vocabulary, c.rows, c.dim, c.dtype.name, c.seed) for c in (static, dynamic)]
    [('static', 1000, 8, 'float32', 1), ('dynamic', None, 8, 'float32', 1)]
    >>> BaseTableConfig.from_layer_config("users", dynamic.to_layer_config()) == dynamic
    True
    """

    name: str
    dim: int
    _: dataclasses.KW_ONLY
    dtype: Any = tf.float32
    initializer: Any = "uniform"
    partitions: Any = None
    seed: Optional[int] = None
    exchange: Optional[Exchange] = None
    placement: Optional[Placement] = None

    VOCABULARY: ClassVar[Vocabulary]
    # {layer-dict key: field} every kind has; each kind adds its own (`layer_keys`), required keys first.
    SHARED_LAYER_KEYS: ClassVar[Dict[str, str]] = {
        "output_dim": "dim",
        "embeddings_initializer": "initializer",
        "partitions": "partitions",
        "seed": "seed",
        "exchange": "exchange",
        "placement": "placement",
    }
    OWN_LAYER_KEYS: ClassVar[Dict[str, str]] = {}
    REQUIRED_LAYER_KEYS: ClassVar[Tuple[str, ...]] = ("output_dim",)
    # Arguments the strategy decides for this kind: a value other than None is refused, not ignored.
    FIXED_BY_STRATEGY: ClassVar[Tuple[str, ...]] = ()
    _KINDS: ClassVar[Dict[Vocabulary, type]] = {}

    def __init_subclass__(cls, vocabulary: Optional[str] = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if vocabulary is not None:
            cls.VOCABULARY = Vocabulary(vocabulary)
            cls._KINDS[cls.VOCABULARY] = cls  # the one registry, defined on the base

    def _set(self, **values) -> None:
        for field, value in values.items():
            object.__setattr__(self, field, value)  # the configs are frozen

    def __post_init__(self):
        if type(self) is BaseTableConfig:
            raise TypeError("BaseTableConfig is a base class. Please make a TableConfig or a DynamicTableConfig")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Argument `name` must be a non-empty string. Received: name={self.name!r}")
        self._set(dim=positive_int("dim", self.dim))
        try:
            self._set(dtype=tf.as_dtype(self.dtype))
        except TypeError as e:
            raise TypeError(f"Argument `dtype` must be a TensorFlow dtype. Received: dtype={self.dtype!r}") from e
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise TypeError(f"Argument `seed` must be an int or None. Received: seed={self.seed!r}")
        self._set(exchange=Exchange.parse_optional(self.exchange, "exchange"))
        self._set(placement=Placement.parse_optional(self.placement, "placement"))
        for arg in self.FIXED_BY_STRATEGY:
            value = getattr(self, arg)
            if value is not None:
                raise ValueError(
                    f"Argument `{arg}` does not apply to a {self.vocabulary} table: the strategy decides it (under "
                    "mirrored strategies one copy on each worker's host, gradients all-gathered). "
                    f"Received: {arg}={value!r}. Please drop the argument."
                )

    @property
    def vocabulary(self) -> Vocabulary:
        return self.VOCABULARY

    @property
    def rows(self) -> Optional[int]:
        return None

    @classmethod
    def layer_keys(cls) -> Dict[str, str]:
        """{layer-dict key: field} of this kind, in the order `to_layer_config` writes them."""
        keys = {**cls.SHARED_LAYER_KEYS, **cls.OWN_LAYER_KEYS}
        return {**{k: keys[k] for k in cls.REQUIRED_LAYER_KEYS}, **keys}

    @classmethod
    def from_layer_config(cls, name: str, config: Any) -> BaseTableConfig:
        """A table config from an `EmbeddingCollection` table dict (`input_dim`, `output_dim`, ...), validated;
        a config is returned as it is.

        The dict's `"vocabulary"` (default: this class's, static on the base)
        picks the kind: `"dynamic"` gives a `DynamicTableConfig`. Errors name
        the dict's key (`tables['name']['output_dim']`).
        """
        if isinstance(config, BaseTableConfig):
            return config
        arg = f"tables['{name}']"
        vocabulary = getattr(cls, "VOCABULARY", Vocabulary.STATIC)
        if isinstance(config, dict):
            vocabulary = Vocabulary.parse(config.get("vocabulary", vocabulary), f"{arg}['vocabulary']")
        kind = cls._KINDS[vocabulary]
        if not isinstance(config, dict) or any(key not in config for key in kind.REQUIRED_LAYER_KEYS):
            required = " and ".join(repr(key) for key in kind.REQUIRED_LAYER_KEYS)
            raise ValueError(f"Argument `{arg}` must be a dict with {required}. Received: {config!r}")
        keys = kind.layer_keys()
        allowed = ("vocabulary", *keys)
        unknown = sorted(set(config) - set(allowed))
        if unknown:
            raise ValueError(
                f"Argument `{arg}` has unknown keys {unknown} for a {vocabulary} table; allowed: {allowed}"
            )
        fields = {keys[key]: value for key, value in config.items() if key != "vocabulary"}
        try:
            return kind.from_fields(name, fields)
        except (TypeError, ValueError) as e:
            raise type(e)(_naming_layer_key(str(e), arg, keys)) from None

    @classmethod
    def from_fields(cls, name: str, fields: dict) -> BaseTableConfig:
        """A config of this kind from `{field: value}` (what `from_layer_config` reads from a layer dict)."""
        return cls(name, **fields)

    def to_layer_config(self) -> dict:
        """The `EmbeddingCollection` table dict of this config (optional keys at their defaults omitted)."""
        config = {} if self.vocabulary == Vocabulary.STATIC else {"vocabulary": self.vocabulary}
        for key, field in self.layer_keys().items():
            value = getattr(self, field)
            default_initializer = field == "initializer" and isinstance(value, str) and value == "uniform"
            if key in self.REQUIRED_LAYER_KEYS or not (value is None or default_initializer):
                config[key] = value
        return config


def _naming_layer_key(message: str, arg: str, keys: Dict[str, str]) -> str:
    """An error about a config field, reworded to name the layer dict's key for it."""
    for key, field in keys.items():
        if f"Argument `{field}`" in message:
            message = message.replace(f"Argument `{field}`", f"Argument `{arg}['{key}']`", 1)
            return message.replace(f"Received: {field}=", f"Received: {arg}['{key}']=", 1)
    return message


@dataclasses.dataclass(frozen=True, init=False)
class TableConfig(BaseTableConfig, vocabulary="static"):
    """A validated description of one sharded table: the arguments of `create_sharded_variable`.

    Constructing one validates every field (the error names the argument);
    `shape` is normalised to a tuple of ints and `dtype` to a `tf.DType`.
    The constructor takes `create_sharded_variable`'s arguments, in its order.

    Names: a table is `rows` x `dim` (`rows` is `shape[0]`; `dim` the
    elements per row, `shape[1]` of a `[rows, dim]` table), the names
    `tfs.plan`'s tables and `create_dynamic_table` already use. Keras's
    `input_dim` / `output_dim` stay the keys of the layer dicts, as in
    Keras's own layers; TorchRec's `num_embeddings` / `embedding_dim` would
    have made a third pair.

    Attributes (beside `BaseTableConfig`'s):
      shape: the full shape `(rows, ...)`.
      trainable: whether gradients reach the table.
      scheme: `tfs.Scheme` where `partitions` is not a `PartitionSpec`.
      ids_per_step: mirrored strategies: a bound on the distinct ids one
        replica looks up per step (feeds the "auto" exchange).

    Example:

    >>> from tf_sharded.config import TableConfig
    >>> config = TableConfig("items", [1000, 8], scheme="mod")
    >>> config.shape, config.rows, config.dim, config.scheme
    ((1000, 8), 1000, 8, 'mod')
    >>> config.to_layer_config()
    {'input_dim': 1000, 'output_dim': 8, 'scheme': 'mod'}
    >>> TableConfig("items", [1000, 8], scheme="modulo")
    Traceback (most recent call last):
    ...
    ValueError: Argument `scheme` must be one of ('div', 'mod', 'balanced'). Received: scheme='modulo'
    """

    dim: int = dataclasses.field(init=False, repr=False)  # from `shape`
    shape: Tuple[int, ...]
    _: dataclasses.KW_ONLY
    trainable: bool = True
    scheme: Optional[Scheme] = None
    ids_per_step: Optional[int] = None

    OWN_LAYER_KEYS: ClassVar[Dict[str, str]] = {"input_dim": "rows", "scheme": "scheme"}
    REQUIRED_LAYER_KEYS: ClassVar[Tuple[str, ...]] = ("input_dim", "output_dim")

    def __init__(
        self,
        name: str,
        shape,
        dtype=tf.float32,
        initializer: Any = "uniform",
        partitions: Any = None,
        trainable: bool = True,
        *,
        scheme: Optional[str] = None,
        seed: Optional[int] = None,
        exchange: Optional[str] = None,
        placement: Optional[str] = None,
        ids_per_step: Optional[int] = None,
    ):
        # Written out to keep that positional order: the base's shared fields are keyword-only.
        self._set(name=name, shape=shape, dtype=dtype, initializer=initializer, partitions=partitions,
             trainable=trainable, scheme=scheme, seed=seed, exchange=exchange, placement=placement,
             ids_per_step=ids_per_step)  # fmt: skip
        self.__post_init__()

    def __post_init__(self):
        self._set(shape=_shape(self.shape))
        self._set(dim=math.prod(self.shape[1:]))
        super().__post_init__()
        if not isinstance(self.trainable, bool):
            raise TypeError(f"Argument `trainable` must be a bool. Received: trainable={self.trainable!r}")
        self._set(scheme=Scheme.parse_optional(self.scheme, "scheme"))
        self._set(ids_per_step=optional_positive_int("ids_per_step", self.ids_per_step))

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def mirrored_only(self) -> dict:
        """The arguments that only mean something under mirrored strategies, where they are not neutral."""
        values = {"exchange": self.exchange, "placement": self.placement, "ids_per_step": self.ids_per_step}
        return {k: v for k, v in values.items() if v not in (None, "auto")}

    @classmethod
    def from_fields(cls, name: str, fields: dict) -> TableConfig:
        shape = (positive_int("rows", fields.pop("rows")), positive_int("dim", fields.pop("dim")))
        return cls(name, shape, **fields)

    def to_layer_config(self) -> dict:
        if len(self.shape) != 2:
            raise ValueError(
                f"Table '{self.name}' of shape {self.shape} has no EmbeddingCollection table dict: those tables "
                "are [input_dim, output_dim]."
            )
        return super().to_layer_config()


@dataclasses.dataclass(frozen=True)
class DynamicTableConfig(BaseTableConfig, vocabulary="dynamic"):
    """A dynamic table (raw int64 or string keys): `create_dynamic_table`'s arguments, validated.

    An `EmbeddingCollection` table dict with `"vocabulary": "dynamic"` gives
    one. Its shards follow the strategy, which also decides where a mirrored
    copy lives and how its gradients travel: `exchange` other than None is
    refused, and `placement` but for "sharded" (under
    MultiWorkerMirroredStrategy, a shard per worker instead of a copy).

    Attributes (beside `BaseTableConfig`'s):
      key_dtype: "int64" or "string".
      admission: None or a `tfs.policies` admission policy.
      eviction: None, a `tfs.policies` eviction policy, or a list of them.
      max_rows: None (unbounded) or the most live keys the table may hold.

    Example:

    >>> from tf_sharded.config import DynamicTableConfig
    >>> config = DynamicTableConfig.from_layer_config("users", {"vocabulary": "dynamic", "output_dim": 8})
    >>> config.shape, config.rows, config.key_dtype
    ((None, 8), None, 'int64')
    >>> DynamicTableConfig("users", 8, placement="device")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Argument `placement` does not apply to a dynamic table: the strategy decides it ...
    """

    _: dataclasses.KW_ONLY
    key_dtype: str = "int64"
    admission: Any = None
    eviction: Any = None
    max_rows: Optional[int] = None

    OWN_LAYER_KEYS: ClassVar[Dict[str, str]] = {
        "key_dtype": "key_dtype",
        "admission": "admission",
        "eviction": "eviction",
        "max_rows": "max_rows",
    }
    FIXED_BY_STRATEGY: ClassVar[Tuple[str, ...]] = ("exchange",)

    def __post_init__(self):
        super().__post_init__()
        if self.placement not in (None, Placement.SHARDED):
            raise ValueError(
                "Argument `placement` does not apply to a dynamic table: the strategy decides it (under mirrored "
                "strategies one copy on each worker's host, gradients all-gathered), but for 'sharded' (a shard "
                f"per worker under MultiWorkerMirroredStrategy). Received: placement={self.placement!r}."
            )
        if self.key_dtype not in ("int64", "string"):
            raise TypeError(f"Argument `key_dtype` must be 'int64' or 'string'. Received: key_dtype={self.key_dtype!r}")
        self._set(partitions=optional_positive_int("partitions", self.partitions))
        self._set(max_rows=optional_positive_int("max_rows", self.max_rows))

    @property
    def shape(self) -> Tuple[Optional[int], int]:
        return (None, self.dim)


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
