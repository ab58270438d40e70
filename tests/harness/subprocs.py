"""Running Python in a child process from a test (clusters, other strategies, the CLI)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(args, timeout=300, env=None):
    """`python ARGS` from the repository root with quiet TF logs; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=_env(env),
    )


def _env(extra):
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(extra or {})}


def run_python_together(commands, timeout=300, env=None):
    """`run_python` for several argument lists at once (their startup and tracing overlap on two cores).

    Returns one CompletedProcess per command, in order; every process is
    killed if they outlive `timeout` together.
    """
    import time

    procs = [
        subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=_env(env))
        for args in commands
    ]  # fmt: skip
    deadline = time.monotonic() + timeout
    results = []
    try:
        for args, p in zip(commands, procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess([sys.executable, *args], p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
