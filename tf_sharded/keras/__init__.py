"""The Keras 3 side: layers, model conversion, optimizers and their gradient routing, fit, checkpoints, export.

Modules: `embedding` (`Embedding`), `collection` (`EmbeddingCollection`),
`conversion` (`shard_embeddings`, `sharded_embeddings`), `layers` (the
`tfs.layers` namespace of those), `optimizers`, `routing` (Keras optimizers
through the mirrored exchange), `training` (`tfs.fit`), `checkpoints`,
`serving` (`tfs.export`). Importing the package installs the routing.
"""

from tf_sharded.keras import routing

routing.install()
