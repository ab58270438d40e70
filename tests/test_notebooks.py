"""Every notebook in colab/ runs headlessly, top to bottom, so none can rot."""

import glob
import json
import os

import nbformat
import pytest
import tensorflow as tf

from tests.harness.subprocs import ROOT, run_python

pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=125)]  # every notebook, executed

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
        # In a process of the run's own network (tests/harness/subprocs.py), with the kernels it starts: their
        # local clusters answer there only, and the kernels' own ports (ZeroMQ on 127.0.0.1) too.
        proc = run_python(["-c", EXECUTE, self.get_temp_dir(), *NOTEBOOKS], timeout=1500)
        self.assertEqual(proc.returncode, 0, proc.stderr[-6000:])  # a failing cell: its traceback
        for path, errors in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            self.assertEqual(errors, [], msg=path)


EXECUTE = """
import concurrent.futures, json, sys, tempfile
import nbformat
from nbclient import NotebookClient

def execute(path):
    notebook = nbformat.read(path, as_version=4)
    workdir = tempfile.mkdtemp(dir=sys.argv[1])
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": workdir}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failure
    return [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]

# Two kernels at a time: a notebook's time is mostly one Python thread (imports, tracing).
with concurrent.futures.ThreadPoolExecutor(2) as pool:
    print(json.dumps(dict(zip(sys.argv[2:], pool.map(execute, sys.argv[2:])))))
"""
