"""tf_sharded.app.restart: when a hybrid job runs its command again, and the line it ends with otherwise.

The restart itself (the command run again in place of the process) is
exercised by the application's kill tests (`tests/app/test_app.py`).
"""

import os
from unittest import mock

import pytest

from tf_sharded.app import restart


@pytest.fixture
def no_exec():
    with mock.patch.object(os, "execve", side_effect=AssertionError("restarted")) as execve:
        yield execve


def test_no_restart_without_a_checkpoint_or_under_tf_config_or_once_spent(no_exec, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv(restart.RESTARTS_ENV, raising=False)
    assert restart.restart("a table server stopped answering", None) is None
    assert restart.ending(None) == "the job ends (without --checkpoint_dir it cannot resume)"
    monkeypatch.setenv("TF_CONFIG", "{}")  # a task of a cluster someone else started: they restart it
    assert restart.restart("a table server stopped answering", "/tmp/ckpt") is None
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.setenv(restart.RESTARTS_ENV, str(restart.MAX_RESTARTS))
    assert restart.restart("a table server stopped answering", "/tmp/ckpt") is None
    assert restart.ending("/tmp/ckpt") == "the job ends after 3 restarts; rerun it to resume from --checkpoint_dir"
    no_exec.assert_not_called()


def test_a_restart_stops_the_cluster_and_runs_the_command_again_counting_itself(no_exec, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv(restart.RESTARTS_ENV, "1")
    monkeypatch.setattr("sys.argv", ["/x/tf_sharded/__main__.py", "train", "--strategy", "hybrid"])
    cluster = mock.Mock()
    with pytest.raises(AssertionError, match="restarted"):
        restart.restart("the local hybrid cluster's worker 1 ended (exit code -9)", "/tmp/ckpt", cluster)
    cluster.stop.assert_called_once_with()
    executable, command, env = no_exec.call_args.args
    assert command[1:] == ["-m", "tf_sharded", "train", "--strategy", "hybrid"] and command[0] == executable
    assert env[restart.RESTARTS_ENV] == "2"
    assert capsys.readouterr().err == (
        "restarting: the local hybrid cluster's worker 1 ended (exit code -9); the job restarts from "
        "--checkpoint_dir (restart 2 of 3)\n"
    )
