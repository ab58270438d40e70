"""Training a Keras model whose tables are sharded: `tfs.fit`, `tfs.evaluate` / `tfs.predict`, checkpoints,
and recovery from a lost parameter server.

Modules: `trainer` (`fit`: the loop each strategy family asks for, the step
counter, `train_function`), `loop` (the coordinator's loop under
ParameterServerStrategy: scheduling, epochs, restarts), `evaluation`
(`evaluate`, `predict`), `checkpoints` (`Checkpoints`,
`PeriodicCheckpoint`, the layout manifest), `recovery` (finding a
restarted parameter server and restoring its variables).
`CheckpointMismatchError`: `fit` refused a checkpoint written by another model.
"""

from tf_sharded.errors import CheckpointMismatchError
from tf_sharded.keras.training.trainer import fit, steps_done, train_function

__all__ = ["CheckpointMismatchError", "fit", "steps_done", "train_function"]
