from setuptools import find_packages, setup

setup(
    name="tf_sharded",
    version="0.1.0",
    description="Sharded embedding tables for TensorFlow 2 distribution strategies",
    python_requires=">=3.10,<3.13",
    # Every package under tf_sharded/ (found, not listed: a new subpackage cannot be left out of the wheel),
    # and the strategy hooks, which live in strategy/ but install inside the library's namespace.
    packages=find_packages(include=["tf_sharded", "tf_sharded.*"]) + ["tf_sharded.strategy"],
    package_dir={"tf_sharded": "tf_sharded", "tf_sharded.strategy": "strategy"},
    install_requires=[
        # Ranges, not pins: the versions a checkout is tested with are in constraints/*.txt.
        "tensorflow>=2.16.2,<2.22",
        "keras>=3.12.0,<4",  # the newest Keras on Python 3.10 is 3.12; grouped int4 needs 3.14
        "numpy>=1.26.4",  # within what the installed TensorFlow allows (NumPy 2 from TF 2.18)
        "absl-py>=1.0.0",
        "portpicker>=1.6.0",  # tfs.cluster's local clusters
    ],
    extras_require={
        # the training application (python -m tf_sharded train / data / inspect)
        # pyarrow writes Parquet (`data synthesize`) and reads it where tensorflow-io's ops do not load.
        # pyarrow 26 needs NumPy 2 at import without declaring it, so on TF 2.16-2.17 (NumPy 1.26) it would
        # install and then fail: below 26 a pyarrow works with either NumPy.
        # TensorBoard reads the summaries `train --logdir` and `tfs.callbacks.TableMetrics` write (a dependency of
        # TensorFlow up to 2.16, not of later releases).
        "app": ["pyarrow>=16.1.0,<26", "tensorboard>=2.16"],
        # tensorflow-io's Parquet reader, used where its compiled ops load (TF 2.16 only, as of 0.37.1).
        "io": ["tensorflow-io>=0.37.1"],
        # the benchmark suite (python -m tf_sharded bench)
        "bench": [
            "pyarrow>=16.1.0,<26",
            "matplotlib>=3.8",  # plots
            "psutil>=5.9",  # process memory (B3)
        ],
        # peer baselines in the benchmarks (B7 measures TFRA beside ours); never needed by `make test`.
        # TFRA 0.8.1 declares tensorflow<=2.16.2, so it installs beside the pinned TensorFlow.
        "peers": ["tensorflow-recommenders-addons>=0.8.1"],
        "test": [
            "pytest-timeout",
            "pytest-random-order",  # opt-in: pytest --random-order-seed=N
            "psutil",  # the cluster tests check that tasks are cleaned up
            "pytest",
            "hypothesis",
            "ruff",
            "pyyaml",  # tests/test_deploy.py parses the Kubernetes manifests
            "tensorboard>=2.16",  # the table metrics' event files, read with TensorBoard's own reader
            # the notebooks in colab/ are executed by the tests
            "nbclient",
            "nbformat",
            "ipykernel",
        ],
    },
    entry_points={"console_scripts": ["tf-sharded=tf_sharded.__main__:main"]},
)
