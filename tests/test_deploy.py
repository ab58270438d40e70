"""The Kubernetes example: the TF_CONFIG each pod's entry point builds is the one TensorFlow expects, and the
manifests keep TensorFlow's servers (which authenticate nothing and run any graph sent to them) to the job's
own pods, running unprivileged on a read-only root filesystem."""

import json
import os
import re
import shlex
import subprocess
from unittest import mock

import tensorflow as tf
import yaml

from tests.harness.subprocs import ROOT

DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
ROLES = ("chief", "worker", "ps")


def entrypoint(role, hostname, **env):
    return subprocess.run(
        ["sh", os.path.join(DEPLOY, "entrypoint.sh")],
        env={"PATH": os.environ["PATH"], "ROLE": role, "HOSTNAME": hostname, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
    )


def tf_config(role, hostname, **env):
    proc = entrypoint(role, hostname, **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def manifest():
    with open(os.path.join(DEPLOY, "ctr-training.yaml")) as f:
        return list(yaml.safe_load_all(f))


def workloads(docs):
    """`{role: workload}` (the StatefulSets and the chief's Job), by the role label of their pod template."""
    found = {}
    for doc in docs:
        if doc["kind"] in ("StatefulSet", "Job"):
            found[doc["spec"]["template"]["metadata"]["labels"]["role"]] = doc
    return found


def containers(pod):
    return pod.get("initContainers", []) + pod["containers"]


def env_of(container):
    return {e["name"]: e["value"] for e in container.get("env", [])}


def hostnames(workload):
    """The HOSTNAME of each pod of `workload`: its StatefulSet ordinals, or the chief Job's fixed hostname."""
    if workload["kind"] == "Job":
        return [workload["spec"]["template"]["spec"]["hostname"]]
    return [f"{workload['metadata']['name']}-{i}" for i in range(workload["spec"]["replicas"])]


def flag(args, name):
    """The value of `--name` in a flag list, or None."""
    for i, arg in enumerate(args):
        if arg == f"--{name}":
            return args[i + 1]
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def volume_at(pod, container, path):
    """(mount, volume) holding `path` in `container` (the deepest mount above it), or (None, None): the root
    filesystem."""
    mounts = [m for m in container.get("volumeMounts", []) if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts:
        return None, None
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return mount, next(v for v in pod["volumes"] if v["name"] == mount["name"])


def dockerfile_user():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    user = re.findall(r"^USER (\d+):(\d+)$", text, re.MULTILINE)[-1]
    return int(user[0]), int(user[1]), text


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
        docs = manifest()
        replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in docs if d["kind"] == "StatefulSet"}
        self.assertEqual(replicas, {"ctr-ps": 2, "ctr-worker": 2})
        jobs = workloads(docs)
        self.assertEqual(sorted(jobs), sorted(ROLES))
        self.assertEqual(jobs["chief"]["spec"]["template"]["spec"]["hostname"], "ctr-chief-0")
        images = [c["image"] for w in jobs.values() for c in containers(w["spec"]["template"]["spec"])]
        self.assertEqual(images, ["tf-sharded:0.1.0"] * 3)
        # Each pod's own environment through the entry point: TF_CONFIG lists as many tasks as there are pods.
        for workload in jobs.values():
            env = env_of(workload["spec"]["template"]["spec"]["containers"][0])
            rest = {k: v for k, v in env.items() if k != "ROLE"}
            for hostname in hostnames(workload):
                cluster = tf_config(env["ROLE"], hostname, **rest)["cluster"]
                self.assertEqual({r: len(cluster[r]) for r in ("worker", "ps")}, {"worker": 2, "ps": 2})

    def test_tf_config_names_only_the_jobs_services(self):
        docs = manifest()
        services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
        jobs = workloads(docs)
        for role, workload in jobs.items():
            pod = workload["spec"]["template"]["spec"]
            env = env_of(pod["containers"][0])
            self.assertEqual(env["ROLE"], role)
            for hostname in hostnames(workload):
                config = tf_config(role, hostname, **{k: v for k, v in env.items() if k != "ROLE"})
                for task_type, addresses in config["cluster"].items():
                    for address in addresses:
                        # <pod>.<service>:<port>, a relative name: it resolves in the pod's own namespace.
                        match = re.fullmatch(r"(([a-z0-9-]+)-\d+)\.([a-z0-9-]+):(\d+)", address)
                        self.assertIsNotNone(match, address)
                        pod_name, service_name, port = match[1], match[3], int(match[4])
                        self.assertEqual(match[2], service_name, address)
                        self.assertIn(service_name, services, f"{address}: not one of the job's services")
                        service = services[service_name]
                        self.assertEqual(service["clusterIP"], "None")
                        target = jobs[task_type]["spec"]["template"]
                        self.assertLessEqual(service["selector"].items(), target["metadata"]["labels"].items())
                        self.assertEqual([p["port"] for p in service["ports"]], [port])
                        # A pod's DNS name: <hostname>.<its StatefulSet's serviceName or its subdomain>.
                        self.assertIn(pod_name, hostnames(jobs[task_type]), address)
                        domain = target["spec"].get("subdomain") or jobs[task_type]["spec"]["serviceName"]
                        self.assertEqual(service_name, domain, address)
                        self.assertEqual([p["containerPort"] for p in target["spec"]["containers"][0]["ports"]], [port])
        named = tf_config("worker", "job-b-worker-0", NAME="job-b")["cluster"]
        self.assertTrue(all(a.startswith("job-b-") for addresses in named.values() for a in addresses), named)

    def test_entrypoint_refuses_what_would_name_other_tasks(self):
        good = {"ROLE": "worker", "HOSTNAME": "ctr-worker-1"}
        bad = [
            ("ROLE", {"ROLE": "boss"}),
            ("ROLE", {"ROLE": ""}),
            ("ROLE", {"ROLE": "worker\nps"}),
            ("ROLE", {"ROLE": 'worker", "index": 0}, "x": {"a'}),
            ("HOSTNAME", {"HOSTNAME": ""}),
            ("HOSTNAME", {"HOSTNAME": "ctr-worker-x"}),
            ("HOSTNAME", {"HOSTNAME": "1"}),  # an ordinal, but not of this job's pods
            ("HOSTNAME", {"HOSTNAME": "ctr-worker-"}),
            ("HOSTNAME", {"HOSTNAME": "ctr-worker-01"}),
            ("HOSTNAME", {"HOSTNAME": "ctr-worker--1"}),
            ("HOSTNAME", {"HOSTNAME": "ctr-ps-1"}),  # another role's pod
            ("HOSTNAME", {"HOSTNAME": "ctr-worker-2"}),  # beyond NUM_WORKERS
            ("HOSTNAME", {"ROLE": "chief", "HOSTNAME": "ctr-chief-1"}),
            ("NUM_WORKERS", {"NUM_WORKERS": "0"}),
            ("NUM_WORKERS", {"NUM_WORKERS": "-1"}),
            ("NUM_WORKERS", {"NUM_WORKERS": "two"}),
            ("NUM_WORKERS", {"NUM_WORKERS": "1.5"}),
            ("NUM_WORKERS", {"NUM_WORKERS": "99999999999999999999"}),
            ("NUM_PS", {"NUM_PS": "0"}),
            ("NUM_PS", {"NUM_PS": " 2"}),
            ("NUM_PS", {"NUM_PS": "02"}),
            ("PORT", {"PORT": "0"}),
            ("PORT", {"PORT": "70000"}),
            ("PORT", {"PORT": "2222/x"}),
            ("NAME", {"NAME": "evil.example.com", "HOSTNAME": "evil.example.com-worker-1"}),
            ("NAME", {"NAME": "Ctr"}),
            ("NAME", {"NAME": "-ctr"}),
            ("NAME", {"NAME": "ctr-"}),
            ("NAME", {"NAME": 'ctr"'}),
        ]
        for name, env in bad:
            with self.subTest(env=env):
                settings = {**good, **env}
                proc = entrypoint(settings.pop("ROLE"), settings.pop("HOSTNAME"), **settings)
                self.assertEqual(proc.returncode, 2, proc.stdout)
                self.assertEqual(proc.stdout, "")
                self.assertLen(proc.stderr.splitlines(), 1, proc.stderr)
                self.assertTrue(proc.stderr.startswith(f"error: {name}"), proc.stderr)
                self.assertIn("received", proc.stderr)

    def test_network_policy_admits_only_the_jobs_pods_on_the_grpc_port(self):
        docs = manifest()
        port = int(tf_config("worker", "ctr-worker-0")["cluster"]["ps"][0].rsplit(":", 1)[1])
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        self.assertLen(policies, 1)
        # First in the file: applied before any task starts serving.
        self.assertIs(docs[0], policies[0])
        self.assertEqual(policies[0]["apiVersion"], "networking.k8s.io/v1")
        spec = policies[0]["spec"]
        # matchLabels only (an empty selector would select every pod of the namespace), carried by every pod.
        self.assertEqual(list(spec["podSelector"]), ["matchLabels"])
        job = spec["podSelector"]["matchLabels"]
        self.assertTrue(job)
        for workload in workloads(docs).values():
            self.assertLessEqual(job.items(), workload["spec"]["template"]["metadata"]["labels"].items())
            for container in workload["spec"]["template"]["spec"]["containers"]:
                self.assertEqual([p["containerPort"] for p in container["ports"]], [port])
        for service in (d for d in docs if d["kind"] == "Service"):
            self.assertEqual([p["port"] for p in service["spec"]["ports"]], [port])
        self.assertEqual(sorted(spec["policyTypes"]), ["Egress", "Ingress"])
        own_pods = [{"podSelector": {"matchLabels": job}}]  # no namespaceSelector: this namespace's pods only
        self.assertEqual(spec["ingress"], [{"from": own_pods, "ports": [{"protocol": "TCP", "port": port}]}])
        # Egress: every rule names its destinations (a rule without `to` admits any), the job's pods on the
        # gRPC port or the cluster's DNS.
        dns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
               "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}  # fmt: skip
        self.assertTrue(spec["egress"])
        for rule in spec["egress"]:
            self.assertTrue(rule.get("to"), rule)
            if rule["to"] == own_pods:
                self.assertEqual(rule["ports"], [{"protocol": "TCP", "port": port}])
            else:
                self.assertEqual(rule["to"], [dns])
                self.assertCountEqual(rule["ports"], [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}])

    def test_containers_run_unprivileged(self):
        uid, gid, dockerfile = dockerfile_user()
        self.assertGreater(uid, 0)
        self.assertIn(f"--uid {uid} --gid {gid}", dockerfile)
        for role, workload in workloads(manifest()).items():
            pod = workload["spec"]["template"]["spec"]
            # No task calls the API server.
            self.assertIs(pod.get("automountServiceAccountToken"), False, role)
            for shared in ("hostNetwork", "hostPID", "hostIPC"):
                self.assertFalse(pod.get(shared, False), role)
            self.assertEqual(pod["securityContext"]["fsGroup"], gid, role)
            inherited = {k: v for k, v in pod["securityContext"].items() if k not in ("fsGroup", "fsGroupChangePolicy")}
            for container in containers(pod):
                context = {**inherited, **container.get("securityContext", {})}
                self.assertIs(context.get("runAsNonRoot"), True, role)
                self.assertEqual((context.get("runAsUser"), context.get("runAsGroup")), (uid, gid), role)
                self.assertIs(context.get("allowPrivilegeEscalation"), False, role)
                self.assertIs(context.get("readOnlyRootFilesystem"), True, role)
                self.assertFalse(context.get("privileged", False), role)
                self.assertEqual(context.get("capabilities"), {"drop": ["ALL"]}, role)
                self.assertEqual(context.get("seccompProfile"), {"type": "RuntimeDefault"}, role)

    def test_every_path_the_app_writes_is_a_volume(self):
        from tf_sharded.app import parquet

        jobs = workloads(manifest())
        pods = {role: w["spec"]["template"]["spec"] for role, w in jobs.items()}
        tf_containers = {role: pod["containers"][0] for role, pod in pods.items()}

        def writable(role, path, kind):
            mount, volume = volume_at(pods[role], tf_containers[role], path)
            self.assertIsNotNone(mount, f"{role}: {path} is on the read-only root filesystem")
            self.assertFalse(mount.get("readOnly", False), f"{role}: {path}")
            self.assertIn(kind, volume, f"{role}: {path}")
            return mount, volume

        def same_volume(role, path, mount, volume):
            # Another task reaches `path` on the same claim at the same place.
            theirs, their_volume = volume_at(pods[role], tf_containers[role], path)
            self.assertIsNotNone(theirs, f"{role}: {path} is not mounted")
            self.assertEqual(theirs["mountPath"], mount["mountPath"], f"{role}: {path}")
            self.assertEqual(their_volume["persistentVolumeClaim"], volume["persistentVolumeClaim"], role)

        for role, container in tf_containers.items():
            env = env_of(container)
            # Python's and TensorFlow's temporary files, and HOME (Keras keeps ~/.keras there): the pod's own.
            writable(role, env.get("TMPDIR", "/tmp"), "emptyDir")
            self.assertIn("HOME", env, f"{role}: HOME would be the image user's, on the read-only root")
            writable(role, env["HOME"], "emptyDir")
        chief_env = env_of(tf_containers["chief"])
        args = shlex.split(chief_env["TRAIN_ARGS"])
        # Checkpoints: written by the chief and, each its part, by every ps (TensorFlow saves each task's
        # variables on that task).
        checkpoints = flag(args, "checkpoint_dir")
        self.assertIsNotNone(checkpoints)
        mount, volume = writable("chief", checkpoints, "persistentVolumeClaim")
        same_volume("ps", checkpoints, mount, volume)
        writable("ps", checkpoints, "persistentVolumeClaim")
        # The Parquet cache: written by the chief, read by every worker's input pipeline.
        with mock.patch.dict(os.environ, {"PATH": os.environ["PATH"], **chief_env}, clear=True):
            cache = flag(args, "cache_dir") or parquet.default_cache_dir()
        mount, volume = writable("chief", cache, "persistentVolumeClaim")
        same_volume("worker", cache, mount, volume)
        # The data: read by the chief (its scan and held-out batches) and every worker.
        data = flag(args, "data")
        mount, volume = volume_at(pods["chief"], tf_containers["chief"], data)
        self.assertIsNotNone(mount, data)
        same_volume("worker", data, mount, volume)
