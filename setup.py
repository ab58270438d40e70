from setuptools import setup

setup(
    name="tf_sharded",
    version="0.1.0",
    description="Sharded embedding tables for TensorFlow 2 distribution strategies",
    python_requires=">=3.9,<3.13",
    packages=[
        "tf_sharded",
        "tf_sharded.app",
        "tf_sharded.benchmarks",
        "tf_sharded.exchange",
        "tf_sharded.keras",
        "tf_sharded.strategy",
        "tf_sharded.table",
    ],
    # The hooks live in strategy/ but install inside the library's namespace.
    package_dir={"tf_sharded": "tf_sharded", "tf_sharded.strategy": "strategy"},
    install_requires=[
        "tensorflow==2.16.2",
        "tensorflow-io==0.37.1",
        "numpy<2",
        "absl-py",
        "keras==3.15.1",  # tf_sharded routes Keras optimizer internals; see _compat.py
        "portpicker==1.6.0",  # tfs.cluster's local clusters
    ],
    extras_require={
        # the training application (python -m tf_sharded train / data / inspect)
        "app": ["pyarrow==16.1.0"],  # writes Parquet in `data synthesize`; pyarrow >= 17 needs NumPy 2
        # the benchmark suite (python -m tf_sharded bench)
        "bench": [
            "pyarrow==16.1.0",
            "matplotlib==3.9.2",  # plots
            "psutil==7.2.2",  # process memory (B3)
        ],
        # peer baselines in the benchmarks (B7 measures TFRA beside ours); never needed by `make test`.
        # TFRA 0.8.1 declares tensorflow<=2.16.2, so it installs beside the pinned TensorFlow.
        "peers": ["tensorflow-recommenders-addons==0.8.1"],
        "test": [
            "pytest-timeout==2.4.0",
            "psutil==7.2.2",  # the cluster tests check that tasks are cleaned up
            "pytest==9.2.0",
            "hypothesis==6.170.15",
            "ruff==0.17.5",
            # the notebooks in colab/ are executed by the tests
            "nbclient==0.11.0",
            "nbformat==5.11.1",
            "ipykernel==7.4.0",
        ],
    },
    entry_points={"console_scripts": ["tf-sharded=tf_sharded.__main__:main"]},
)
