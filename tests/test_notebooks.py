"""Every notebook in colab/ runs headlessly, top to bottom, so none can rot."""

import concurrent.futures
import glob
import os
import tempfile

import nbformat
import pytest
import tensorflow as tf
from nbclient import NotebookClient

from tests.harness.subprocs import ROOT

pytestmark = pytest.mark.slow  # every notebook, executed

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

        def execute(path):
            notebook = nbformat.read(path, as_version=4)
            workdir = tempfile.mkdtemp(dir=self.get_temp_dir())
            client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                                    resources={"metadata": {"path": workdir}})  # fmt: skip
            client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failure
            return [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]

        # Two kernels at a time: a notebook's time is mostly one Python thread (imports, tracing).
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for path, errors in zip(NOTEBOOKS, pool.map(execute, NOTEBOOKS)):
                self.assertEqual(errors, [], msg=path)
