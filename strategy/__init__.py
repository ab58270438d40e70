"""Per-strategy hooks behind `strategy.create_sharded_variable`.

Each strategy family lives in its own module and registers a hook for its
strategy types with `register`. Lookup walks the strategy's MRO, so
subclasses of a supported strategy are served by its hook. Importing this
package installs `create_sharded_variable` on every `tf.distribute.Strategy`.
"""

from __future__ import annotations

from typing import Callable, Dict

from tf_sharded.errors import UnsupportedStrategyError

_HOOKS: Dict[type, Callable] = {}


def register(*strategy_types: type) -> Callable:
    """Registers the decorated function as the hook of `strategy_types`.

    A hook is called as `hook(strategy, request)` with a
    `tf_sharded.creation.VariableRequest` and returns a `tfs.ShardedVariable`.
    """

    def decorator(hook: Callable) -> Callable:
        for t in strategy_types:
            _HOOKS[t] = hook
        return hook

    return decorator


def supported_strategies() -> list:
    """Names of the strategy types that have a hook."""
    return sorted({t.__name__ for t in _HOOKS})


def hook_for(strategy) -> Callable:
    """The hook serving `strategy`, or `UnsupportedStrategyError`."""
    for t in type(strategy).__mro__:
        if t in _HOOKS:
            return _HOOKS[t]
    raise UnsupportedStrategyError(strategy, supported_strategies())


from tf_sharded.strategy import default as default  # noqa: E402  (registers hooks)
from tf_sharded.strategy import mirrored as mirrored  # noqa: E402
from tf_sharded.strategy import parameter_server as parameter_server  # noqa: E402
