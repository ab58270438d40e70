"""The training application (`python -m tf_sharded train`), its data and models; the `[app]` extra.

Modules: `cli` (the `train` and `inspect` commands), `data` (synthetic
Criteo-shaped data, TSV and Parquet readers), `models` (DLRM, DeepFM over
`tfs.layers`), `demo` (the single-table walkthrough).
"""
