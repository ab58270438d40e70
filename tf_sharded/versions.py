"""The TensorFlow and Keras releases tf_sharded supports, checked when it is imported.

The ranges match `setup.py`'s and what CI tests (the oldest and the newest
stack in `constraints/`). Another release is refused at import with one
error naming it and the range, since the internals `tf_sharded._compat`
reaches are only known to hold within it; `TF_SHARDED_SKIP_VERSION_CHECK=1`
lets a user try one anyway (a nightly, say).
"""

from __future__ import annotations

import os
import re
from typing import Tuple

# [oldest, first unsupported): the oldest is the oldest stack's release.
TENSORFLOW = ("2.16.2", "2.22")
KERAS = ("3.12.0", "4")
SKIP = "TF_SHARDED_SKIP_VERSION_CHECK"


def parse(version: str) -> Tuple[int, ...]:
    """`"2.21.0"` -> (2, 21, 0); a suffix ("rc1", "-dev2026...") is ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("-")[0].split("rc")[0])[:3])


def supported(version: str, bounds: Tuple[str, str]) -> bool:
    return parse(bounds[0]) <= parse(version) < parse(bounds[1])


def check(tensorflow_version: str, keras_version: str) -> None:
    """Raises ImportError naming the first of the two releases outside its supported range."""
    if os.environ.get(SKIP) == "1":
        return
    for name, version, bounds in (("TensorFlow", tensorflow_version, TENSORFLOW), ("Keras", keras_version, KERAS)):
        if not supported(version, bounds):
            raise ImportError(
                f"tf_sharded supports {name} >={bounds[0]},<{bounds[1]}. Received: {name} {version}. "
                f"Install a supported release (pip install 'tf_sharded' resolves one), or set {SKIP}=1 to try "
                "this one anyway."
            )
