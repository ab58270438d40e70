"""Argument checks shared by the strategy families."""

from __future__ import annotations


def refuse_mirrored_arguments(config, strategy_name: str) -> None:
    """Refuses mirrored-only arguments where there is nothing to exchange or mirror."""
    for arg, value in config.mirrored_only.items():
        raise ValueError(
            f"Argument `{arg}` only applies under MirroredStrategy and MultiWorkerMirroredStrategy. "
            f"Received: {arg}={value!r} under {strategy_name}, where gradients are applied on the shard that "
            "owns the row. Please drop the argument."
        )
