"""The command's terminal: TensorFlow's C++ log hidden by default, shown with `--verbose` or the user's level."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tests.harness.subprocs import ROOT

# What TensorFlow logs from C++ while it loads and starts, on one tested stack or the other.
TF_LOG_MARKERS = ("oneDNN", "cuda", "absl::InitializeLog", "cpu_feature_guard", "TensorRT", "cuInit")


def run_command(args, level=None):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    return subprocess.run(
        [sys.executable, "-m", "tf_sharded", *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )


class QuietCommandTest(tf.test.TestCase):
    @pytest.mark.slow  # starts a Python process with TensorFlow
    def test_a_command_prints_its_own_lines_only_unless_asked(self):
        missing = os.path.join(self.get_temp_dir(), "nothing_here")
        quiet = run_command(["inspect", missing])
        self.assertEqual(quiet.returncode, 1)
        # One line on stderr: the command's error, nothing of TensorFlow's.
        self.assertEqual(len(quiet.stderr.splitlines()), 1, quiet.stderr)
        self.assertTrue(quiet.stderr.startswith(f"error: inspect: no checkpoint at '{missing}'"), quiet.stderr)
        loud = run_command(["inspect", missing, "--verbose"])
        self.assertEqual(loud.returncode, 1)
        self.assertIn(f"error: inspect: no checkpoint at '{missing}'", loud.stderr)
        self.assertTrue(any(m in loud.stderr for m in TF_LOG_MARKERS), loud.stderr[-2000:])
        # The user's own level is theirs: 0 shows what TensorFlow logs at that level.
        own = run_command(["inspect", missing], level="0")
        self.assertTrue(any(m in own.stderr for m in TF_LOG_MARKERS), own.stderr[-2000:])

    @pytest.mark.slow  # starts a Python process with TensorFlow
    def test_importing_the_library_leaves_the_process_as_it_is(self):
        code = "import os, tf_sharded; print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'))"
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env=env)  # fmt: skip
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        self.assertEqual(done.stdout.strip(), "None")


def test_trains_own_verbose_flag_is_not_the_log_switch():
    # `--verbose` alone shows TensorFlow's log; `train --verbose 0` (or `--verbose=0`) is train's progress flag.
    from tf_sharded import _console

    assert _console.without_switch(["inspect", "ckpt", "--verbose"]) == ["inspect", "ckpt"]
    assert _console.without_switch(["train", "--verbose", "--steps", "2"]) == ["train", "--steps", "2"]
    for args in (["train", "--verbose", "0"], ["train", "--verbose=1"], ["train", "--steps", "2"]):
        assert _console.without_switch(args) == args
