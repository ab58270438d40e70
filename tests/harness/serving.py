"""Loading an export where tf_sharded cannot be imported."""

import os

import numpy as np

from tests.harness.subprocs import run_python

# Serves an export in a process where importing tf_sharded fails.
SERVE_WITHOUT_TF_SHARDED = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tf_sharded" or name.startswith("tf_sharded."):
            raise ImportError("tf_sharded is not installed on this machine")
sys.meta_path.insert(0, Block())
import numpy as np, tensorflow as tf
try:
    import tf_sharded
except ImportError:
    pass
else:
    raise SystemExit("tf_sharded was importable")
loaded = tf.saved_model.load(sys.argv[1])
if len(sys.argv) > 5:
    loaded.signatures["apply_delta"](path=tf.constant(sys.argv[5]))
served = loaded.signatures["serving_default"]
out = served(**{k: tf.constant(np.load(sys.argv[2] + "/" + k + ".npy")) for k in sys.argv[4].split(",")})
np.save(sys.argv[3], out["output_0"].numpy())
print("served", sorted(sys.modules.get("tf_sharded", {}) and ["tf_sharded"]))
"""


def serve_elsewhere(test, path, inputs, delta=None):
    """The export at `path` served on `inputs` by a process without tf_sharded (after applying `delta` if given)."""
    folder = test.get_temp_dir()
    for k, v in inputs.items():
        np.save(os.path.join(folder, k + ".npy"), v)
    out = os.path.join(folder, "served.npy")
    args = [path, folder, out, ",".join(inputs)] + ([delta] if delta else [])
    proc = run_python(["-c", SERVE_WITHOUT_TF_SHARDED] + args, timeout=180)
    test.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    return np.load(out)
