import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Parquet conversions (tf_sharded.app.parquet) go to a directory of the run, not the user's cache; the
# processes the tests start inherit it.
os.environ.setdefault("TF_SHARDED_CACHE", tempfile.mkdtemp(prefix="tfs_test_cache_"))

import tensorflow as tf  # noqa: E402

# Four virtual CPUs for MirroredStrategy tests; must happen before TF initialises.
NUM_VIRTUAL_CPUS = 4
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_VIRTUAL_CPUS)


def pytest_collection_modifyitems(config, items):
    """Mirrored tests first, tests that connect to the in-process PS cluster last.

    Connecting this process to a cluster renames its job; a MirroredStrategy
    created before then stops resolving its devices, and one created after
    hangs in its collectives. So no mirrored test may run after a connection.
    """

    def rank(item):
        if item.get_closest_marker("mirrored"):
            return 0
        if item.get_closest_marker("ps_cluster"):
            return 2
        return 1

    items.sort(key=rank)
