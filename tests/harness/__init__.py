"""What the tests share: strategies, step builders, single-device references, graph checks, child processes.

* `strategies` -- the strategies under test (Mirrored on virtual CPUs with
  either placement, the in-process parameter-server cluster, MultiWorker
  workers as child processes) and small helpers to feed them.
* `bodies` -- `StrategyBodies`, the test bodies every strategy runs.
* `steps` -- training steps built the way users write them.
* `references` -- the same computation on one device with plain TF / Keras.
* `graphs` -- checks on traced graphs (no whole-table reads, op types).
* `subprocs` -- running Python (clusters, the CLI) in a child process.
* `serving` -- loading an export where tf_sharded cannot be imported.
"""
