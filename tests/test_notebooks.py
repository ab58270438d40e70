"""Every notebook in colab/ runs headlessly, top to bottom, so none can rot."""

import glob
import os

import nbformat
import tensorflow as tf
from nbclient import NotebookClient

from tests.harness.subprocs import ROOT

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colab", "*.ipynb")))


class NotebookTest(tf.test.TestCase):
    def test_there_are_the_four_notebooks(self):
        names = {os.path.basename(n) for n in NOTEBOOKS}
        expected = {"quickstart", "mirrored_exchange", "dlrm_end_to_end", "dynamic_vocabularies"}
        expected = {f"{name}.ipynb" for name in expected}
        self.assertEqual(names, expected)
        for path in NOTEBOOKS:
            first_code = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
            self.assertIn('"google.colab" in sys.modules', first_code.source, msg=path)  # installs on Colab

    def test_notebooks_execute(self):
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        for path in NOTEBOOKS:
            notebook = nbformat.read(path, as_version=4)
            client = NotebookClient(
                notebook,
                timeout=600,
                kernel_name="python3",
                resources={"metadata": {"path": self.get_temp_dir()}},
            )
            client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failure
            errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
            self.assertEqual(errors, [], msg=path)
