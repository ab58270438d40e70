import os
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Parquet conversions (tf_sharded.app.parquet) go to a directory of the run, not the user's cache; the
# processes the tests start inherit it.
os.environ.setdefault("TF_SHARDED_CACHE", tempfile.mkdtemp(prefix="tfs_test_cache_"))

import tensorflow as tf  # noqa: E402

# Four virtual CPUs for MirroredStrategy tests; must happen before TF initialises.
NUM_VIRTUAL_CPUS = 4
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_VIRTUAL_CPUS)

# Set in the child process that runs the `ps_cluster` tests: the file naming the tests it runs.
CLUSTER_TESTS = "TF_SHARDED_TEST_CLUSTER_TESTS"
_CHILD_KEY = pytest.StashKey[tuple]()


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(session, config, items):
    """Tests marked `ps_cluster` run in one child process; every other test in this one.

    Connecting a process to a cluster renames its job: a MirroredStrategy
    created before then stops resolving its devices, and one created after
    hangs in its collectives. So a process that connects never runs anything
    else, and each of the two runs its tests in whatever order it is given.
    The child starts as soon as this process has collected, and runs beside
    it: cluster tests spend much of their time waiting on RPCs, and most
    other tests keep one of the two cores busy.
    """
    listed = os.environ.get(CLUSTER_TESTS)
    if listed:  # the child: exactly the cluster tests the parent collected
        with open(listed) as f:
            wanted = set(f.read().splitlines())
        items[:] = [item for item in items if item.nodeid in wanted]
        return
    cluster = [item for item in items if item.get_closest_marker("ps_cluster")]
    if not cluster or len(cluster) == len(items) or config.option.collectonly:
        return  # nothing else runs here: no need for a second process
    items[:] = [item for item in items if not item.get_closest_marker("ps_cluster")]
    config.stash[_CHILD_KEY] = _start_child(config, [item.nodeid for item in cluster])


def _start_child(config, nodeids):
    """Starts pytest on `nodeids` with this run's arguments; its output goes to a file printed at the end."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listed:
        listed.write("\n".join(nodeids))
    output = tempfile.TemporaryFile("w+")
    # The same arguments (paths, options, a random-order seed), from the same directory.
    args = [sys.executable, "-m", "pytest", *config.invocation_params.args]
    env = {**os.environ, CLUSTER_TESTS: listed.name}
    from tests.harness.subprocs import network  # its cluster answers in the run's own network

    child = subprocess.Popen(
        args, cwd=config.invocation_params.dir, env=env, stdout=output, stderr=subprocess.STDOUT, preexec_fn=network()
    )
    return child, output, listed.name, len(nodeids)


def pytest_sessionfinish(session, exitstatus):
    started = session.config.stash.get(_CHILD_KEY, None)
    if started is None:
        return
    child, output, listed, count = started
    try:
        child.wait()
    except BaseException:  # interrupted: the child goes too
        child.kill()
        raise
    finally:
        os.unlink(listed)
    output.seek(0)
    print(f"\n{count} tests marked ps_cluster ran in a child process (it connects to a cluster):")
    print(output.read(), end="")
    output.close()
    sys.stdout.flush()
    if child.returncode != 0 and session.exitstatus == 0:
        session.exitstatus = child.returncode
