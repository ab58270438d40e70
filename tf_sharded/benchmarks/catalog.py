"""The benchmarks of the suite: each name's module and what it measures, and which run once whatever the
cluster mode. Read by the runner (`suite`) and the results page (`report`)."""

# name -> (module, what it measures)
BENCHMARKS = {
    "ps": ("tf_sharded.benchmarks.ps_lookup", "B1 + B5: parameter-server lookup + update vs TF-native, Keras, limit"),
    "exchange": ("tf_sharded.benchmarks.exchange", "B2: mirrored gradient exchange sweep"),
    "fused": ("tf_sharded.benchmarks.fused", "B6: EmbeddingCollection vs one layer per table"),
    "memory": ("tf_sharded.benchmarks.memory", "B3: resident memory per task (one process per task)"),
    "e2e": ("tf_sharded.benchmarks.end_to_end", "B4: DLRM samples/s per strategy vs keras.layers.Embedding"),
    "dynamic": ("tf_sharded.benchmarks.dynamic", "B7: dynamic tables (raw keys) vs static tables, inserts, memory"),
    "dynamic_churn": ("tf_sharded.benchmarks.churn", "B7 churn: a capacity-bounded dynamic table under all-new keys"),
    "recovery": ("tf_sharded.benchmarks.recovery", "B8: ps failure: tfs.fit recovery vs a program restart"),
    "quantize": ("tf_sharded.benchmarks.quantize", "B9: the demo model served with int8 / int4 tables vs float"),
    "mwprofile": ("tf_sharded.benchmarks.multi_worker_profile", "B10: a multi-worker mirrored step taken apart"),
    "plan": ("tf_sharded.benchmarks.plan", "B11: tfs.plan's choices against the measured options, its constants"),
    "sharded": ("tf_sharded.benchmarks.sharded", "B12: tables sharded over the replicas vs mirrored copies"),
    "hybrid": ("tf_sharded.benchmarks.hybrid", "B13: hybrid training vs multi-worker mirrored and parameter servers"),
    "metrics": ("tf_sharded.benchmarks.table_metrics", "B14: application samples/s with table metrics and without"),
}
# Benchmarks that pick their own cluster (or none): run once, whatever --mode says.
SINGLE_RUN = ("exchange", "memory", "e2e", "recovery", "quantize", "mwprofile", "sharded", "hybrid", "metrics")
