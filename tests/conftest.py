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


@pytest.fixture(autouse=True)
def _own_collective_keys():
    """Gives each test's mirrored strategies group keys no earlier test used, as TensorFlow's own tests do.

    Every `MirroredStrategy` and `MultiWorkerMirroredStrategy` of a process
    starts its collectives at group key 1 and instance key 100, and
    TensorFlow remembers an instance's shape for the process's life: a
    strategy whose instance 100 carries another shape than an earlier
    strategy's fails with "Shape mismatch in the collective instance 100".
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as collective
    from tensorflow.python.distribute import mirrored_strategy as mirrored

    for cls in (
        mirrored.MirroredStrategy,
        mirrored.MirroredStrategyV1,
        collective.CollectiveAllReduceStrategy,
        collective.CollectiveAllReduceStrategyV1,
    ):
        cls._collective_key_base += 100_000
    yield


# Set in a child process: the file naming the tests it runs.
CHILD_TESTS = "TF_SHARDED_TEST_CHILD_TESTS"
_CHILDREN_KEY = pytest.StashKey[list]()
# Child processes for the tests marked `processes`.
PROCESS_GROUPS = 2
# Their scheduling priority, below this process's (and the cluster child's).
PROCESS_GROUPS_NICENESS = 10
# CPU seconds assumed for a file marked `processes` without a `cost`.
DEFAULT_PROCESS_COST = 30
# A run of in-process tests alone (none marked `processes`, as `make test-fast`) of at least this many tests
# shares them with a second process, one core each.
SPLIT_IN_PROCESS_FROM = 200


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(session, config, items):
    """Tests marked `ps_cluster` run in one child process; those marked `processes` in two others.

    Connecting a process to a cluster renames its job: a MirroredStrategy
    created before then stops resolving its devices, and one created after
    hangs in its collectives. So a process that connects never runs anything
    else, and each process runs its tests in whatever order it is given.
    Tests marked `processes` spend their time waiting on processes they
    start (the commands, clusters of processes, notebooks); they are split
    by file into two groups of about equal cost (`_balanced_groups`). The
    children start as soon as this process has collected and run beside it. Those two run (with every process they
    start) at a lower priority: the in-process tests here are latency-bound
    (MirroredStrategy's replica threads hand work to one another and wait on
    each hand-over), and with two cores kept busy by the commands' processes
    they ran 10 to 100 times slower than alone.
    """
    listed = os.environ.get(CHILD_TESTS)
    if listed:  # a child: exactly the tests the parent gave it
        with open(listed) as f:
            wanted = set(f.read().splitlines())
        items[:] = [item for item in items if item.nodeid in wanted]
        return
    if config.option.collectonly:
        return
    cluster = [item for item in items if item.get_closest_marker("ps_cluster")]
    rest = [item for item in items if not item.get_closest_marker("ps_cluster")]
    waiting = [item for item in rest if item.get_closest_marker("processes")]
    group_of = _balanced_groups(waiting)
    groups = [(cluster, 0)] + [([item for item in waiting if group_of[item.path] == g], PROCESS_GROUPS_NICENESS)
                               for g in range(PROCESS_GROUPS)]  # fmt: skip
    if not waiting and len(rest) >= SPLIT_IN_PROCESS_FROM:
        # Without processes to wait on, one process keeps one core busy: every other test goes to a second one
        # (a file's parametrized cases, often the costly ones, are spread over both).
        groups.append((rest[1::2], 0))
    groups = [(group, nice) for group, nice in groups if group]
    if not groups or (len(groups) == 1 and len(groups[0][0]) == len(items)):
        return  # nothing else runs here: no need for a second process
    moved = {id(item) for group, _ in groups for item in group}
    items[:] = [item for item in items if id(item) not in moved]
    config.stash[_CHILDREN_KEY] = [
        _start_child(config, [item.nodeid for item in group], nice) for group, nice in groups
    ]


def _balanced_groups(items) -> dict:
    """The group of each file of `items` (tests marked `processes`): files by their `cost` (the marker's
    argument: the CPU seconds of the file and the processes it starts in a full run here, the measure that
    counts when every core is busy; DEFAULT_PROCESS_COST if not given), largest first, each to the group with
    the least cost so far, so that the groups end together."""
    cost = {}
    for item in items:
        marker = item.get_closest_marker("processes")
        cost[item.path] = max(cost.get(item.path, 0), marker.kwargs.get("cost", DEFAULT_PROCESS_COST))
    loads, group_of = [0] * PROCESS_GROUPS, {}
    for path in sorted(cost, key=lambda p: (-cost[p], str(p))):
        group_of[path] = loads.index(min(loads))
        loads[group_of[path]] += cost[path]
    return group_of


def _start_child(config, nodeids, nice: int = 0):
    """Starts pytest on `nodeids` with this run's arguments, `nice` below this process's priority; its output goes
    to a file printed at the end."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as listed:
        listed.write("\n".join(nodeids))
    output = tempfile.TemporaryFile("w+")
    # The same arguments (paths, options, a random-order seed), from the same directory.
    args = [sys.executable, "-m", "pytest", *config.invocation_params.args]
    env = {**os.environ, CHILD_TESTS: listed.name}
    from tests.harness.subprocs import network  # its clusters answer in the run's own network

    join = network()

    def prepare():
        if join is not None:
            join()
        os.nice(nice)

    child = subprocess.Popen(
        args, cwd=config.invocation_params.dir, env=env, stdout=output, stderr=subprocess.STDOUT, preexec_fn=prepare
    )
    return child, output, listed.name, nodeids


def pytest_sessionfinish(session, exitstatus):
    children = session.config.stash.get(_CHILDREN_KEY, [])
    for child, output, listed, nodeids in children:
        try:
            child.wait()
        except BaseException:  # interrupted: the children go too
            for other in children:
                other[0].kill()
            raise
        finally:
            os.unlink(listed)
        output.seek(0)
        files = sorted({nodeid.split("::")[0] for nodeid in nodeids})
        print(f"\n{len(nodeids)} tests ran in a child process ({', '.join(files)}):")
        print(output.read(), end="")
        output.close()
        sys.stdout.flush()
        if child.returncode != 0 and session.exitstatus == 0:
            session.exitstatus = child.returncode


# CPU seconds per test (this process's and the processes it started and waited for): on two cores the suite's
# time is its CPU time, which wall-clock durations hide once several groups share the cores.
_CPU_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-durations", type=int, default=0, metavar="N", help="show the N tests that used the most CPU seconds"
    )


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = _cpu_seconds()
    yield
    spent = item.config.stash.setdefault(_CPU_KEY, {})
    spent[item.nodeid] = _cpu_seconds() - start


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    count = config.getoption("--cpu-durations")
    spent = config.stash.get(_CPU_KEY, {})
    if not count or not spent:
        return
    terminalreporter.write_sep("=", f"most CPU seconds ({sum(spent.values()):.0f} s in all, this process's tests)")
    for nodeid, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:count]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
