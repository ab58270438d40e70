"""The Kubernetes example: the TF_CONFIG each pod's entry point builds is the one TensorFlow expects."""

import json
import os
import re
import subprocess

import tensorflow as tf

from tests.harness.subprocs import ROOT

DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")


def tf_config(role, hostname, **env):
    proc = subprocess.run(
        ["sh", os.path.join(DEPLOY, "entrypoint.sh")],
        env={"PATH": os.environ["PATH"], "ROLE": role, "HOSTNAME": hostname, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


class KubernetesExampleTest(tf.test.TestCase):
    def test_entrypoint_builds_each_tasks_tf_config(self):
        worker = tf_config("worker", "ctr-worker-1")
        self.assertEqual(
            worker["cluster"],
            {
                "chief": ["ctr-chief-0.ctr-chief:2222"],
                "worker": ["ctr-worker-0.ctr-worker:2222", "ctr-worker-1.ctr-worker:2222"],
                "ps": ["ctr-ps-0.ctr-ps:2222", "ctr-ps-1.ctr-ps:2222"],
            },
        )
        self.assertEqual(worker["task"], {"type": "worker", "index": 1})
        self.assertEqual(tf_config("chief", "ctr-chief-0")["task"], {"type": "chief", "index": 0})
        bigger = tf_config("ps", "ctr-ps-3", NUM_PS="4", NUM_WORKERS="8", PORT="3333")
        self.assertLen(bigger["cluster"]["ps"], 4)
        self.assertLen(bigger["cluster"]["worker"], 8)
        self.assertEqual(bigger["cluster"]["ps"][3], "ctr-ps-3.ctr-ps:3333")
        # TensorFlow's resolver reads it as intended.
        os.environ["TF_CONFIG"] = json.dumps(worker)
        try:
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            self.assertEqual((resolver.task_type, resolver.task_id), ("worker", 1))
            self.assertEqual(len(resolver.cluster_spec().as_dict()["ps"]), 2)
        finally:
            del os.environ["TF_CONFIG"]

    def test_manifest_sizes_agree_with_the_entrypoint_defaults(self):
        with open(os.path.join(DEPLOY, "ctr-training.yaml")) as f:
            manifest = f.read()
        replicas = dict(re.findall(r"name: (ctr-\w+)}\nspec:\n  serviceName: \S+\n  replicas: (\d+)", manifest))
        self.assertEqual(replicas, {"ctr-ps": "2", "ctr-worker": "2"})
        self.assertIn("hostname: ctr-chief-0", manifest)
        self.assertEqual(manifest.count("image: tf-sharded:0.1.0"), 3)
