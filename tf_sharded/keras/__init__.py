"""The Keras 3 side: layers, model conversion, optimizers and their gradient routing, fit, checkpoints, export.

Modules: `embedding` (`Embedding`), `collection` (`EmbeddingCollection`),
`conversion` (`shard_embeddings`, `sharded_embeddings`), `layers` (the
`tfs.layers` namespace of those), `optimizers`, `routing` (Keras optimizers
through the mirrored exchange), the `training` subpackage (`tfs.fit`, evaluation, checkpoints, recovery),
`serving` (`tfs.export`). The routing is installed when the process creates its first table, so a
process that never does runs Keras's optimizers as Keras ships them.
"""

from tf_sharded.keras import routing
from tf_sharded.table.protocol import on_first_table

on_first_table(routing.install)
