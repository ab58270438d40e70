"""The feature schema: which columns of a user's file are the label and the features, and how each is encoded.

A schema is a JSON file (`--schema FILE`):

    {
      "label": {"name": "rating", "type": "regression"},
      "features": [
        {"name": "age", "type": "numeric", "transform": "standardize"},
        {"name": "occupation", "type": "categorical", "buckets": 32},
        {"name": "user_id", "type": "categorical", "buckets": 10000},
        {"name": "movie_id", "type": "categorical", "buckets": 5000, "table": "movie"},
        {"name": "genres", "type": "multi_hot", "buckets": 32, "delimiter": "|", "combiner": "mean"}
      ]
    }

The label is `binary` (0/1; cross-entropy, AUC, log-loss) or `regression`
(MSE, RMSE). Numeric columns are transformed by `none`, `log1p`
(`log(1 + max(x, 0))`) or `standardize` (`(x - mean) / std`, from a
statistics pass over the training files, kept with the checkpoint); a missing
numeric value is 0 after the transform. Categorical columns (integer ids or
strings) are hashed into `buckets` rows: row 0 is "missing", values go to
`1 + hash(text) mod (buckets - 1)` over their decimal or string text, so an id
hashes the same whether a file stores it as a number or as a string. With
`"vocabulary": "dynamic"` (or `train --vocabulary dynamic`) a column's values
are instead the keys of a dynamic table, as text ("" when missing): no
`buckets`, no collisions. Such a column may bound its table, so that a job
over days of logs does not grow without end: `"min_count": n` gives a key a
row once it has occurred n times (`tfs.policies.MinCountAdmission`),
`"evict_after_steps": n` frees the rows of keys unseen for n steps
(`StepsSinceSeenEviction`), `"max_keys": n` holds at most n live keys, the
least recently seen going first (`CapacityEviction`). `train --min_count`,
`--evict_after_steps` and `--max_keys` set them for dynamic columns that do
not.
Multi-hot columns are lists (Parquet, TFRecord) or `delimiter`-separated
text (TSV, CSV), looked up with `combiner` (`sum`, `mean`, `sqrtn`).
Features with the same `table` share one embedding table (their `buckets`
must agree); a feature without `table` has its own, named after it.

`infer(path)` writes a starting schema from a file.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from tf_sharded.config import Combiner


class SchemaError(ValueError):
    """A schema that cannot be used; the message names the file and the entry."""


class LabelType(str, enum.Enum):
    BINARY = "binary"
    REGRESSION = "regression"


class FeatureType(str, enum.Enum):
    NUMERIC = "numeric"
    CATEGORICAL = "categorical"
    MULTI_HOT = "multi_hot"


class Transform(str, enum.Enum):
    NONE = "none"
    LOG1P = "log1p"
    STANDARDIZE = "standardize"


@dataclasses.dataclass(frozen=True)
class Label:
    name: str
    type: LabelType = LabelType.BINARY


@dataclasses.dataclass(frozen=True)
class Feature:
    """One input column. `buckets`, `table`, `delimiter` and `combiner` apply to categorical / multi-hot."""

    name: str
    type: FeatureType
    transform: Transform = Transform.NONE
    buckets: Optional[int] = None
    table: Optional[str] = None
    delimiter: str = "|"
    combiner: Combiner = Combiner.MEAN
    # "hashed" (ids = 1 + hash mod (buckets - 1)) or "dynamic" (raw values as string keys of a dynamic table).
    vocabulary: str = "hashed"
    # A dynamic table's bounds (None: none): admission by count, eviction by steps unseen, most live keys.
    min_count: Optional[int] = None
    evict_after_steps: Optional[int] = None
    max_keys: Optional[int] = None
    # standardize: mean and standard deviation from the statistics pass (None until it ran).
    mean: Optional[float] = None
    std: Optional[float] = None

    @property
    def table_name(self) -> str:
        return self.table or self.name

    def policies(self) -> Dict[str, int]:
        """The bounds this feature sets on its dynamic table, `{key: value}` of those given."""
        return {k: getattr(self, k) for k in POLICY_KEYS if getattr(self, k) is not None}


# A dynamic column's bounds on its table, as the schema file and `train`'s flags name them.
POLICY_KEYS = ("min_count", "evict_after_steps", "max_keys")


@dataclasses.dataclass(frozen=True)
class Schema:
    label: Label
    features: Tuple[Feature, ...]

    @property
    def numeric(self) -> List[Feature]:
        return [f for f in self.features if f.type == FeatureType.NUMERIC]

    @property
    def embedded(self) -> List[Feature]:
        """Categorical and multi-hot features, in schema order."""
        return [f for f in self.features if f.type != FeatureType.NUMERIC]

    @property
    def columns(self) -> List[str]:
        """Every column a file must have: the label first, then the features in schema order."""
        return [self.label.name] + [f.name for f in self.features]

    def tables(self) -> Dict[str, Optional[int]]:
        """`{table name: rows}` in first-use order (None: a dynamic table, no fixed rows)."""
        tables: Dict[str, Optional[int]] = {}
        for f in self.embedded:
            tables.setdefault(f.table_name, None if f.vocabulary == "dynamic" else f.buckets)
        return tables

    def with_vocabulary(self, vocabulary: str) -> Schema:
        """A copy whose categorical and multi-hot features all use `vocabulary` ("hashed" or "dynamic")."""
        features = tuple(
            f if f.type == FeatureType.NUMERIC else dataclasses.replace(f, vocabulary=vocabulary) for f in self.features
        )
        return dataclasses.replace(self, features=features)

    def with_policies(self, **given: Optional[int]) -> Schema:
        """A copy whose dynamic features take the bounds in `given` (`POLICY_KEYS`, None: not given) where they
        set none of their own."""
        features = tuple(
            dataclasses.replace(f, **{k: v for k, v in given.items() if v is not None and getattr(f, k) is None})
            if f.vocabulary == "dynamic"
            else f
            for f in self.features
        )
        return dataclasses.replace(self, features=features)

    def table_policies(self) -> Dict[str, Dict[str, int]]:
        """`{table name: {bound: value}}` of the dynamic tables that have bounds; features sharing a table must
        agree (a schema file's are checked when it is read; flags fill in those a feature leaves out)."""
        found: Dict[str, Tuple[Dict[str, int], str]] = {}
        for f in self.embedded:
            if f.vocabulary != "dynamic":
                continue
            if f.table_name in found and found[f.table_name][0] != f.policies():
                bounds, other = found[f.table_name]
                raise SchemaError(
                    f"features '{other}' and '{f.name}' share table '{f.table_name}' but have bounds {bounds} and "
                    f"{f.policies()} (the flags fill in a feature's own bounds only where it sets none)"
                )
            found.setdefault(f.table_name, (f.policies(), f.name))
        return {table: bounds for table, (bounds, _) in found.items() if bounds}

    def needs_statistics(self) -> bool:
        return any(f.transform == Transform.STANDARDIZE and f.mean is None for f in self.numeric)

    def with_statistics(self, stats: Dict[str, Tuple[float, float]]) -> Schema:
        """A copy whose standardized columns carry `stats[name] = (mean, std)`."""
        features = tuple(
            dataclasses.replace(f, mean=float(stats[f.name][0]), std=float(stats[f.name][1]))
            if f.transform == Transform.STANDARDIZE and f.name in stats
            else f
            for f in self.features
        )
        return dataclasses.replace(self, features=features)

    def to_json(self) -> dict:
        def feature(f: Feature) -> dict:
            out = {"name": f.name, "type": f.type.value}
            if f.type == FeatureType.NUMERIC:
                out["transform"] = f.transform.value
                if f.mean is not None:
                    out.update(mean=f.mean, std=f.std)
            else:
                if f.vocabulary == "dynamic":
                    out["vocabulary"] = "dynamic"
                    out.update(f.policies())
                if f.buckets is not None:
                    out["buckets"] = f.buckets
                if f.table:
                    out["table"] = f.table
            if f.type == FeatureType.MULTI_HOT:
                out.update(delimiter=f.delimiter, combiner=f.combiner.value)
            return out

        return {
            "label": {"name": self.label.name, "type": self.label.type.value},
            "features": [feature(f) for f in self.features],
        }


def _enum(kind, value, where: str, key: str):
    try:
        return kind(value)
    except ValueError:
        allowed = [k.value for k in kind]
        raise SchemaError(f"{where}: `{key}` must be one of {allowed}. Received: {value!r}") from None


_FEATURE_KEYS = {
    FeatureType.NUMERIC: {"name", "type", "transform", "mean", "std"},
    FeatureType.CATEGORICAL: {"name", "type", "buckets", "table", "vocabulary", *POLICY_KEYS},
    FeatureType.MULTI_HOT: {"name", "type", "buckets", "table", "delimiter", "combiner", "vocabulary", *POLICY_KEYS},
}


def _feature(entry, where: str) -> Feature:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry.get("name"):
        raise SchemaError(f"{where}: expected an object with a non-empty string `name`. Received: {entry!r}")
    where = f"{where} ('{entry['name']}')"
    kind = _enum(FeatureType, entry.get("type"), where, "type")
    unknown = sorted(set(entry) - _FEATURE_KEYS[kind])
    if unknown:
        raise SchemaError(f"{where}: unknown key(s) {unknown} for a {kind.value} feature")
    if kind == FeatureType.NUMERIC:
        transform = _enum(Transform, entry.get("transform", "none"), where, "transform")
        mean, std = entry.get("mean"), entry.get("std")
        if (mean is None) != (std is None) or (std is not None and not (_finite(mean) and _finite(std) and std > 0)):
            raise SchemaError(f"{where}: `mean` and `std` go together, with std > 0. Received: {mean!r}, {std!r}")
        return Feature(entry["name"], kind, transform=transform, mean=mean, std=std)
    vocabulary = entry.get("vocabulary", "hashed")
    if vocabulary not in ("hashed", "dynamic"):
        raise SchemaError(f"{where}: `vocabulary` must be 'hashed' or 'dynamic'. Received: {vocabulary!r}")
    buckets = entry.get("buckets")
    if vocabulary == "dynamic" and buckets is None:
        pass  # raw values are the keys: no buckets
    elif not isinstance(buckets, int) or isinstance(buckets, bool) or buckets < 2:
        raise SchemaError(f"{where}: `buckets` must be an integer >= 2 (row 0 is 'missing'). Received: {buckets!r}")
    table = entry.get("table")
    if table is not None and (not isinstance(table, str) or not table):
        raise SchemaError(f"{where}: `table` must be a non-empty string. Received: {table!r}")
    bounds = {k: entry[k] for k in POLICY_KEYS if k in entry}
    for key, value in bounds.items():
        if vocabulary != "dynamic":
            raise SchemaError(f'{where}: `{key}` bounds a dynamic table: it needs "vocabulary": "dynamic"')
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SchemaError(f"{where}: `{key}` must be a positive integer. Received: {value!r}")
    if kind == FeatureType.CATEGORICAL:
        return Feature(entry["name"], kind, buckets=buckets, table=table, vocabulary=vocabulary, **bounds)
    delimiter = entry.get("delimiter", "|")
    if not isinstance(delimiter, str) or len(delimiter) != 1:
        raise SchemaError(f"{where}: `delimiter` must be one character. Received: {delimiter!r}")
    combiner = _enum(Combiner, entry.get("combiner", "mean"), where, "combiner")
    return Feature(
        entry["name"], kind, buckets=buckets, table=table, delimiter=delimiter, combiner=combiner,
        vocabulary=vocabulary, **bounds,
    )  # fmt: skip


def parse(config: dict, source: str = "schema") -> Schema:
    """A validated `Schema` from its JSON object; errors name `source` and the entry."""
    if not isinstance(config, dict):
        raise SchemaError(f"{source}: expected an object with `label` and `features`. Received: a JSON {_kind(config)}")
    unknown = sorted(set(config) - {"label", "features"})
    if unknown:
        raise SchemaError(f"{source}: unknown key(s) {unknown}; a schema has `label` and `features`")
    label = config.get("label")
    if isinstance(label, dict) and set(label) - {"name", "type"}:
        raise SchemaError(f"{source}: label: unknown key(s) {sorted(set(label) - {'name', 'type'})}")
    if not isinstance(label, dict) or not isinstance(label.get("name"), str) or not label.get("name"):
        raise SchemaError(f'{source}: `label` must be {{"name": ..., "type": "binary"|"regression"}}. Got {label!r}')
    label = Label(label["name"], _enum(LabelType, label.get("type", "binary"), f"{source}: label", "type"))
    entries = config.get("features")
    if not isinstance(entries, list) or not entries:
        raise SchemaError(f"{source}: `features` must be a non-empty list. Received: {entries!r}")
    features = tuple(_feature(e, f"{source}: features[{i}]") for i, e in enumerate(entries))
    names = [label.name] + [f.name for f in features]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SchemaError(f"{source}: column(s) {repeated} appear more than once (label and features)")
    if not any(f.type != FeatureType.NUMERIC for f in features):
        raise SchemaError(f"{source}: at least one categorical or multi_hot feature is needed (an embedding table)")
    rows: Dict[str, Tuple[tuple, str]] = {}
    for f in features:
        if f.type == FeatureType.NUMERIC:
            continue
        if f.table_name in rows and rows[f.table_name][0] != (f.buckets, f.vocabulary, f.policies()):
            (buckets, vocabulary, bounds), other = rows[f.table_name]
            differ = f"vocabulary {vocabulary} and {f.vocabulary}" if vocabulary != f.vocabulary else ""
            if not differ and bounds != f.policies():
                differ = f"bounds {bounds} and {f.policies()}"
            raise SchemaError(
                f"{source}: features '{other}' and '{f.name}' share table '{f.table_name}' but have "
                + (differ or f"buckets {buckets} and {f.buckets}")
            )
        rows.setdefault(f.table_name, ((f.buckets, f.vocabulary, f.policies()), f.name))
    return Schema(label, features)


def _model_fields(feature: Feature) -> dict:
    """What of a feature shapes the model: everything but the statistics, which a resumed run takes over."""
    fields = dataclasses.asdict(feature)
    for statistic in ("mean", "std"):
        fields.pop(statistic)
    return {k: v.value if isinstance(v, enum.Enum) else v for k, v in fields.items()}


def differences(saved: Schema, given: Schema) -> List[str]:
    """How schema `given` differs from `saved` in what shapes a model (statistics aside), one phrase each;
    empty when a model of either restores the other's checkpoints."""
    found = []
    if saved.label != given.label:
        found.append(
            f"label '{saved.label.name}' ({saved.label.type.value}) saved, '{given.label.name}' "
            f"({given.label.type.value}) given"
        )
    before, after = {f.name: f for f in saved.features}, {f.name: f for f in given.features}
    for names, where in (
        ([n for n in before if n not in after], "saved"),
        ([n for n in after if n not in before], "given"),
    ):
        if names:
            found.append(f"feature(s) {names} only in the {where} schema")
    for name in (n for n in before if n in after):
        a, b = _model_fields(before[name]), _model_fields(after[name])
        changed = [f"{k} {a[k]!r} saved, {b[k]!r} given" for k in a if a[k] != b[k]]
        if changed:
            found.append(f"feature '{name}': {', '.join(changed)}")
    if not found and list(before) != list(after):
        found.append(f"the features in another order: {list(before)} saved, {list(after)} given")
    return found


def load(path: str) -> Schema:
    """The schema in JSON file `path`."""
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as e:
        raise SchemaError(f"cannot read schema file {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SchemaError(f"schema file {path!r} is not JSON: {e}") from None
    return parse(config, path)


def save(schema: Schema, path: str) -> None:
    """Writes `schema` to JSON file `path` whole or not at all: a reader sees the file as it was or as it is
    now, never a part (every worker of a job keeps its schema beside the same checkpoints, and another may be
    reading it meanwhile)."""
    partial = f"{path}.tmp-{os.getpid()}"
    try:
        with open(partial, "w") as f:
            json.dump(schema.to_json(), f, indent=2)
            f.write("\n")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def criteo(vocab: Sequence[int]) -> Schema:
    """Criteo's layout: binary `label`, `I1`..`I13` numeric (log1p), `C1`..`C26` categorical into `vocab`."""
    features = [Feature(f"I{i}", FeatureType.NUMERIC, transform=Transform.LOG1P) for i in range(1, 14)]
    features += [Feature(f"C{i}", FeatureType.CATEGORICAL, buckets=int(v)) for i, v in enumerate(vocab, 1)]
    return Schema(Label("label", LabelType.BINARY), tuple(features))


def infer_from_columns(
    columns: Dict[str, List], label: Optional[str] = None, max_buckets: int = 1_000_000, list_columns=()
) -> Schema:
    """A starting schema from sample values per column (text values from TSV/CSV, typed ones otherwise).

    The label is `label` or the first column; it is binary when its values
    are all 0/1. A column whose values all parse as numbers and take many
    distinct values is numeric (log1p when non-negative and skewed, else
    standardize); integer columns with few distinct values or named like an
    id (`id`, `user_id`, `movieId`), and strings, are categorical, with buckets twice the distinct values seen (at least
    16, at most `max_buckets`); list columns, and text columns with `|` in a
    value, are multi-hot.
    """
    names = list(columns)
    if not names:
        raise SchemaError("cannot infer a schema: the file has no columns")
    label_name = label or names[0]
    if label_name not in columns:
        raise SchemaError(f"cannot infer a schema: no column {label_name!r}; the file has {names}")
    label_values = [v for v in columns[label_name] if v not in ("", None)]
    binary = bool(label_values) and all(str(v) in ("0", "1", "0.0", "1.0", "True", "False") for v in label_values)
    features = []
    for name in names:
        if name == label_name:
            continue
        values = [v for v in columns[name] if v not in ("", None)]
        distinct = len({repr(v) for v in values})
        buckets = int(min(max_buckets, max(16, 2 * distinct)))
        is_list = name in list_columns or any(isinstance(v, str) and "|" in v for v in values)
        if is_list:
            items = {str(x) for v in values for x in (v if isinstance(v, (list, tuple)) else str(v).split("|"))}
            buckets = int(min(max_buckets, max(16, 2 * len(items))))
            features.append(Feature(name, FeatureType.MULTI_HOT, buckets=buckets))
            continue
        numbers = _numbers(values)
        integral = numbers is not None and all(float(x).is_integer() for x in numbers)
        few = distinct <= max(16, len(values) // 20)
        if numbers is not None and values and not (integral and (few or _named_like_id(name))):
            skewed = min(numbers) >= 0 and _skew(numbers) > 1.0
            transform = Transform.LOG1P if skewed else Transform.STANDARDIZE
            features.append(Feature(name, FeatureType.NUMERIC, transform=transform))
        else:
            features.append(Feature(name, FeatureType.CATEGORICAL, buckets=buckets))
    if not any(f.type != FeatureType.NUMERIC for f in features):
        # A model needs one table: the column with the fewest distinct values becomes categorical.
        fewest = min(features, key=lambda f: len({repr(v) for v in columns[f.name]}))
        features = [
            Feature(f.name, FeatureType.CATEGORICAL, buckets=max(16, 2 * len(set(map(repr, columns[f.name])))))
            if f is fewest
            else f
            for f in features
        ]
    kind = LabelType.BINARY if binary else LabelType.REGRESSION
    return Schema(Label(label_name, kind), tuple(features))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _kind(value) -> str:
    """A JSON value's kind, as JSON names it."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _named_like_id(name: str) -> bool:
    return re.search(r"(^|[^a-z])id$", name.lower()) is not None or name.endswith(("Id", "ID"))


def _numbers(values) -> Optional[List[float]]:
    out = []
    for v in values:
        if isinstance(v, bool):
            return None
        try:
            x = float(v)
        except (TypeError, ValueError):
            return None
        if not math.isfinite(x):
            return None
        out.append(x)
    return out


def _skew(x: List[float]) -> float:
    n = len(x)
    mean = sum(x) / n
    var = sum((v - mean) ** 2 for v in x) / n
    if var == 0:
        return 0.0
    return sum((v - mean) ** 3 for v in x) / n / var**1.5
