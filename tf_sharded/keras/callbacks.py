"""`tfs.callbacks`: Keras callbacks for models with tf_sharded tables."""

from tf_sharded.keras.table_metrics import TableMetrics

__all__ = ["TableMetrics"]
