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
_CLUSTER_KEY = pytest.StashKey[list]()


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(session, config, items):
    """Tests marked `ps_cluster` run in one child process; every other test in this one.

    Connecting a process to a cluster renames its job: a MirroredStrategy
    created before then stops resolving its devices, and one created after
    hangs in its collectives. So a process that connects never runs anything
    else, and each of the two runs its tests in whatever order it is given.
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
    config.stash[_CLUSTER_KEY] = [item.nodeid for item in cluster]


def pytest_sessionfinish(session, exitstatus):
    nodeids = session.config.stash.get(_CLUSTER_KEY, None)
    if not nodeids:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(nodeids))
    print(f"\n{len(nodeids)} tests marked ps_cluster: running them in a child process (it connects to a cluster)")
    sys.stdout.flush()
    # The same arguments (paths, options, a random-order seed), from the same directory.
    args = [sys.executable, "-m", "pytest", *session.config.invocation_params.args]
    child = subprocess.run(args, cwd=session.config.invocation_params.dir, env={**os.environ, CLUSTER_TESTS: f.name})
    os.unlink(f.name)
    if child.returncode != 0 and session.exitstatus == 0:
        session.exitstatus = child.returncode
