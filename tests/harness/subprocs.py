"""Running Python in a child process from a test (clusters, other strategies, the CLI).

Every process started here joins the test run's own network namespace
(`tf_sharded.isolation`): the clusters the tests start answer on that
namespace's loopback only, and the tasks of one `TF_CONFIG` cluster, each
started on its own, still reach one another there.
"""

import atexit
import os
import subprocess
import sys

from tf_sharded import isolation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_holder = []  # the process holding the run's namespace (none where one cannot be made)


def _enter_or_fail():
    reason = isolation.enter()
    if reason:
        raise OSError(reason)


def network():
    """`preexec_fn` for `subprocess.Popen`: joins the run's network namespace (None where there is none)."""
    if not _holder:
        try:
            holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                                      preexec_fn=_enter_or_fail)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            print(f"the tests' processes share this machine's network: no namespace of their own ({e})")
            holder = None
        else:
            atexit.register(holder.kill)
        _holder.append(holder)
    if _holder[0] is None:
        return None
    pid = _holder[0].pid
    return lambda: isolation.join(pid)


def run_python(args, timeout=300, env=None):
    """`python ARGS` from the repository root with quiet TF logs; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=_env(env),
        preexec_fn=network(),
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
                         env=_env(env), preexec_fn=network())
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


def run_cli_here(args) -> subprocess.CompletedProcess:
    """`python -m tf_sharded ...` (`args` as for `run_python`) called in this process: its exit code, stdout
    and stderr as a `CompletedProcess`, without the interpreter and TensorFlow start-up of a process of its
    own. For commands that end before training (bad input, help, synthetic data); a test keeps one real
    process run beside these for what only a process boundary shows."""
    import contextlib
    import io

    from tf_sharded import __main__ as entry

    assert list(args[:2]) == ["-m", "tf_sharded"], args
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = entry.main(list(args[2:]))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess([sys.executable, *args], code, out.getvalue(), err.getvalue())
