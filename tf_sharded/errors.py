"""Exception types raised by tf_sharded.

Every error follows one grammar: it names the argument, says what was
expected and what was received, and, where the user is on a wrong path,
points at the right one.
"""

from __future__ import annotations

from typing import Any


def positive_int(name: str, value: Any) -> int:
    """Returns `value` if it is a positive int, else raises naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Argument `{name}` must be a positive integer. Received: {name}={value!r} (of type {type(value).__name__})"
        )
    return value


class ShardedError(Exception):
    """Base class of the errors that tf_sharded defines itself."""


class UnsupportedStrategyError(ShardedError, TypeError):
    """Raised when a sharded variable is requested under a strategy we do not serve.

    Attributes:
      strategy: the strategy that was in scope.
      supported: names of the strategy types that have a registered hook.
    """

    def __init__(self, strategy: Any, supported: list[str], what: str = "sharded variables"):
        self.strategy = strategy
        self.supported = list(supported)
        super().__init__(
            f"`strategy` must be one of the strategies tf_sharded supports for {what}: "
            f"{', '.join(self.supported)}. Received: strategy="
            f"{type(strategy).__name__}. It looks like you are creating a table "
            "under a strategy without a tf_sharded hook for it; please use one "
            "of the supported strategies, or create the table outside its scope."
        )


class LayoutMismatchError(ShardedError, ValueError):
    """Raised when a checkpointed table cannot be restored into a variable.

    Attributes:
      name: the variable being restored.
      checkpoint_key: the key of the table in the checkpoint.
      saved_shape: full logical shape found in the checkpoint.
      saved_dtype: dtype found in the checkpoint.
      expected_shape: full logical shape of the restoring variable.
      expected_dtype: dtype of the restoring variable.
    """

    def __init__(
        self,
        name: str,
        checkpoint_key: str,
        saved_shape: Any,
        saved_dtype: Any,
        expected_shape: Any,
        expected_dtype: Any,
    ):
        self.name = name
        self.checkpoint_key = checkpoint_key
        self.saved_shape = list(saved_shape)
        self.saved_dtype = saved_dtype
        self.expected_shape = list(expected_shape)
        self.expected_dtype = expected_dtype
        super().__init__(
            f"Cannot restore checkpoint entry `{checkpoint_key}` into sharded "
            f"variable '{name}': the checkpoint holds shape {self.saved_shape} "
            f"dtype {getattr(saved_dtype, 'name', saved_dtype)}, the variable "
            f"expects shape {self.expected_shape} dtype "
            f"{getattr(expected_dtype, 'name', expected_dtype)}. Nothing was "
            "assigned. Create the variable with the checkpoint's full shape and "
            "dtype (the number of shards and the scheme may differ)."
        )


class CheckpointMismatchError(ShardedError, ValueError):
    """Raised when a checkpoint was written by another model, before anything is restored.

    Its entries are compared with the model's variables and tables first: an
    entry the model lacks, a variable the checkpoint lacks, or a shape, dtype
    or key dtype that differs refuses the whole restore, so the model keeps
    its weights and its step count.

    Attributes:
      path: the checkpoint.
      differences: one line per entry that differs: the checkpoint key, what
        it is in the model, and what each side holds.
    """

    SHOWN = 4

    def __init__(self, path: str, differences: list[str]):
        self.path = path
        self.differences = list(differences)
        shown = "; ".join(self.differences[: self.SHOWN])
        more = len(self.differences) - self.SHOWN
        super().__init__(
            f"Cannot restore checkpoint {path!r}: it was written by another model "
            f"({len(self.differences)} difference(s): {shown}{f'; and {more} more' if more > 0 else ''}). "
            "Nothing was restored. Resume with the model that wrote it (the same layers, table shapes and "
            "optimizer), or write to another checkpoint directory."
        )
