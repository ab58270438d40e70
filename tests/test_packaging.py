"""A regular install: the wheel built from a clean copy of the checkout, installed into a fresh venv.

Every other test imports the editable install, which finds every module of
the source tree whether the wheel holds it or not. Here the fresh venv takes
its dependencies from the test venv's site-packages (a path only: the editable
install's finder there is not loaded), has neither the checkout nor the
editable finder on its path, and runs from a directory outside the checkout:
`import tf_sharded` and a four-step `python -m tf_sharded train` (the
default job, whose cluster tasks are processes of that venv too).
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

import pytest
import tensorflow as tf

from tests.harness.subprocs import ROOT, network

pytestmark = [pytest.mark.slow, pytest.mark.processes(cost=20), pytest.mark.timeout(900)]


def _clean_copy(target: str) -> None:
    """The files git tracks (what a fresh clone holds), copied to `target`."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for path in filter(None, listed.decode().split("\0")):
        source = os.path.join(ROOT, path)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(target, path)), exist_ok=True)
            shutil.copy2(source, os.path.join(target, path))


class WheelInstallTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.work = tempfile.mkdtemp(prefix="tfs_wheel_")
        source, dist = os.path.join(cls.work, "source"), os.path.join(cls.work, "dist")
        _clean_copy(source)
        build = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", dist, source]
        subprocess.run(build, check=True, capture_output=True, timeout=300)
        (cls.wheel,) = [os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".whl")]
        cls.venv = os.path.join(cls.work, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", cls.venv], check=True, timeout=120)
        cls.python = os.path.join(cls.venv, "bin", "python")
        install = [sys.executable, "-m", "pip", "--python", cls.python, "install", "--no-deps", "--no-index", "-q"]
        subprocess.run(install + [cls.wheel], check=True, capture_output=True, timeout=300)
        site = subprocess.run([cls.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        with open(os.path.join(site, "test_venv_dependencies.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")
        cls.outside = os.path.join(cls.work, "elsewhere")
        os.makedirs(cls.outside)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)
        super().tearDownClass()

    def run_installed(self, args, timeout=300):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        return subprocess.run([self.python, *args], cwd=self.outside, env=env, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=network())  # fmt: skip

    def test_the_wheel_holds_every_module_of_the_source(self):
        with zipfile.ZipFile(self.wheel) as wheel:
            held = {n for n in wheel.namelist() if n.endswith(".py")}
        listed = subprocess.run(["git", "ls-files", "tf_sharded", "strategy"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.split()  # fmt: skip
        sources = {re.sub(r"^strategy/", "tf_sharded/strategy/", p) for p in listed if p.endswith(".py")}
        self.assertEmpty(sources - held, "modules the wheel lacks")
        self.assertNotIn("strategy/__init__.py", held)  # installed as tf_sharded.strategy, never as `strategy`

    def test_import_outside_the_checkout_loads_the_installed_package(self):
        proc = self.run_installed(["-c", "import tf_sharded, tf_sharded.hybrid; print(tf_sharded.__file__)"])
        self.assertEqual(proc.returncode, 0, msg=proc.stderr[-3000:])
        location = proc.stdout.strip().splitlines()[-1]
        self.assertStartsWith(location, self.venv)
        self.assertNotIn(ROOT + os.sep, location)

    def test_four_training_steps_of_the_default_job(self):
        checkpoints = os.path.join(self.work, "ckpt")
        proc = self.run_installed(["-m", "tf_sharded", "train", "--steps", "4", "--checkpoint_dir", checkpoints],
                                  timeout=600)  # fmt: skip
        self.assertEqual(proc.returncode, 0, msg=proc.stdout[-3000:] + proc.stderr[-3000:])
        self.assertNotEmpty(tf.io.gfile.glob(os.path.join(checkpoints, "*.index")), msg=proc.stdout[-3000:])

    def test_the_kubernetes_image_installs_the_built_wheel(self):
        with open(os.path.join(ROOT, "deploy", "kubernetes", "Dockerfile")) as f:
            text = f.read()
        self.assertRegex(text, r"pip wheel [^\n]*-w /wheels /src")
        installs = [line for line in text.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
        self.assertTrue(installs and all("/wheels/tf_sharded-" in line for line in installs), installs)
        self.assertNotIn(" -e ", text)
