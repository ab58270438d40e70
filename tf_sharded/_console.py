"""A quiet terminal for the `tf_sharded` command: TensorFlow's C++ start-up and device notices hidden.

TensorFlow logs from C++ straight to file descriptor 2: oneDNN and CUDA
notices, cuFFT/cuDNN/cuBLAS factory registrations, TensorRT, function-cache
clean-up at exit. `TF_CPP_MIN_LOG_LEVEL` hides most of it, but only when set
before TensorFlow loads, and from TF 2.17 on the lines logged while its
libraries load come through absl before its logging is set up, where that
variable does not reach. So when this process is the command (`python -m
tf_sharded ...` or `tf-sharded ...`), without `--verbose` and without the
user's own `TF_CPP_MIN_LOG_LEVEL`, the package sets `TF_CPP_MIN_LOG_LEVEL=3`
(the processes the command starts inherit it) and loads TensorFlow and Keras
with descriptor 2 pointed at a temporary file, which is shown if that fails.
A library user's process is left as it is.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

VERBOSE = "--verbose"
LEVEL = "TF_CPP_MIN_LOG_LEVEL"


def _command_args():
    """The arguments after the command when this process is the `tf_sharded` command, else None."""
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    if "-m" in argv:
        at = argv.index("-m")
        return argv[at + 2 :] if argv[at + 1 : at + 2] == ["tf_sharded"] else None
    if os.path.basename(sys.argv[0] or "") == "tf-sharded":
        return sys.argv[1:]
    return None


def _switches(args) -> list:
    """Positions of `--verbose` given alone: `train`'s own `--verbose N` (its progress output) is not the switch."""
    return [i for i, a in enumerate(args) if a == VERBOSE and not _number(args, i + 1)]


def _number(args, i) -> bool:
    return i < len(args) and args[i].lstrip("-").isdigit()


def without_switch(args) -> list:
    """`args` without the `--verbose` switch (which no command takes as a flag)."""
    drop = set(_switches(args))
    return [a for i, a in enumerate(args) if i not in drop]


def quiet() -> bool:
    """Whether this process is the command, asked for no TensorFlow log (no `--verbose`, no level of its own)."""
    args = _command_args()
    return args is not None and not _switches(args) and LEVEL not in os.environ


@contextlib.contextmanager
def quiet_import():
    """Around the package's first import of TensorFlow: silent where `quiet()`, else nothing."""
    if not quiet() or "tensorflow" in sys.modules:
        yield
        return
    os.environ[LEVEL] = "3"
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode("utf-8", "replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
