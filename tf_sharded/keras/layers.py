"""`tfs.layers`: the Keras 3 layers and the one-line model switches."""

from tf_sharded.keras.collection import EmbeddingCollection
from tf_sharded.keras.conversion import shard_embeddings, sharded_embeddings
from tf_sharded.keras.dynamic_embedding import DynamicEmbedding
from tf_sharded.keras.embedding import Embedding

__all__ = ["DynamicEmbedding", "Embedding", "EmbeddingCollection", "shard_embeddings", "sharded_embeddings"]
