"""What the library and the application read from outside is read as data, and what does not fit is refused.

docs/security.md's "What the library reads from outside" is the catalogue; this file
checks what it claims that other test files do not:

* No library module (tf_sharded/, strategy/) has a way to run input as code:
  an AST scan refuses `eval` / `exec` / `compile`, pickle and its kin
  (marshal, shelve, dill, cloudpickle, joblib, `read_pickle`), `allow_pickle`
  other than False, PyYAML's unsafe loaders, a shell (`shell=True`,
  `os.system`, `os.popen`, `subprocess.getoutput`), Keras's `safe_mode`
  other than True and `enable_unsafe_deserialization`, and an import of a
  module named by a variable, but at the few sites listed in `ALLOWED`
  with the reason their names never come from input. The scan is shown to
  catch each pattern in a file of its own.
* The refusals, each in one line naming the input, before anything is
  applied: schema files, TF_CONFIG, data in no known format, checkpoint
  directories written with another schema or by another model, `inspect`
  on what is not a checkpoint, dynamic tables' key files,
  `LocalCluster(imports=...)`.
* Every test the catalogue's table names exists.

The application runs in this process (`cli.main`, `__main__.main`) on a few
hundred rows under the default strategy: no Python process is started.
"""

import ast
import contextlib
import io
import json
import os
import pathlib
import re
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import tf_sharded as tfs
from tests.test_layout import MODULES, ROOT, TREES

# -------------------------------------------------------------------------------------- the scan --

UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
CODE_BUILTINS = {"eval", "exec", "compile"}
SHELLS = {"os": {"system", "popen"}, "subprocess": {"getoutput", "getstatusoutput"}}
UNSAFE_YAML = {"unsafe_load", "unsafe_load_all", "full_load", "full_load_all", "Loader", "UnsafeLoader", "FullLoader"}
COMPUTED_IMPORT = "import of a module named by a variable"

# Sites that import a module named by a variable: {(module, function, rule): why the name is not input}.
ALLOWED = {
    ("tf_sharded.cluster", "_serve", COMPUTED_IMPORT): (
        "a process task imports what its parent's program passed to LocalCluster(imports=...), given on the "
        "task's command line; dotted names only (`_checked_imports`), as a program chooses its own imports"
    ),
    ("tf_sharded.benchmarks.suite", "_child", COMPUTED_IMPORT): "a module of the BENCHMARKS catalogue",
    ("tf_sharded.benchmarks.suite", "main", COMPUTED_IMPORT): "a module of the BENCHMARKS catalogue",
}


def _last(func) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _owner(func) -> str:
    return ast.unparse(func.value).rsplit(".", 1)[-1] if isinstance(func, ast.Attribute) else ""


def _is(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _call_rules(node: ast.Call) -> list:
    func, name, owner = node.func, _last(node.func), _owner(node.func)
    keywords = {k.arg: k.value for k in node.keywords if k.arg}
    rules = []
    if isinstance(func, ast.Name) and name in CODE_BUILTINS:
        rules.append(f"{name}()")
    if name in SHELLS.get(owner, ()):
        rules.append(f"{owner}.{name}()")
    if "shell" in keywords and not _is(keywords["shell"], False):
        rules.append("shell=True")
    if ("allow_pickle" in keywords and not _is(keywords["allow_pickle"], False)) or (
        name == "load" and owner in ("np", "numpy") and len(node.args) >= 3
    ):
        rules.append("allow_pickle=True")
    if name == "read_pickle":
        rules.append("read_pickle()")
    if owner == "yaml" and name in UNSAFE_YAML:
        rules.append(f"yaml.{name}")
    if owner == "yaml" and name in ("load", "load_all"):
        loader = keywords.get("Loader", node.args[1] if len(node.args) > 1 else None)
        if loader is None or not ast.unparse(loader).endswith("SafeLoader"):
            rules.append(f"yaml.{name} without SafeLoader")
    if "safe_mode" in keywords and not _is(keywords["safe_mode"], True):
        rules.append("safe_mode=False")
    if name == "enable_unsafe_deserialization":
        rules.append("enable_unsafe_deserialization()")
    if name in ("__import__", "import_module"):
        if not (node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            rules.append(COMPUTED_IMPORT)
    return rules


def _import_rules(node) -> list:
    if isinstance(node, ast.Import):
        return [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
    module = (node.module or "").split(".")[0]
    if module in UNSAFE_MODULES:
        return [f"import {node.module}"]
    unsafe = SHELLS.get(module, set()) | (UNSAFE_YAML if module == "yaml" else set())
    return [f"from {module} import {a.name}" for a in node.names if a.name in unsafe]


def unsafe_uses(tree: ast.AST) -> list:
    """`(line, enclosing function, rule)` for each way `tree` has of running input as code."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                found.extend((child.lineno, function, rule) for rule in _call_rules(child))
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((child.lineno, function, rule) for rule in _import_rules(child))
            visit(child, inner)

    visit(tree, "<module>")
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_can_run_input_as_code(module):
    problems = [(line, function, rule) for line, function, rule in unsafe_uses(TREES[module])
                if (module, function, rule) not in ALLOWED]  # fmt: skip
    assert not problems, f"{MODULES[module].relative_to(ROOT)} could run input as code: {problems}"


def test_every_allowed_site_is_still_there():
    found = {(module, function, rule) for module, tree in TREES.items() for _, function, rule in unsafe_uses(tree)}
    assert set(ALLOWED) <= found, f"no longer needed, remove from ALLOWED: {set(ALLOWED) - found}"


FORBIDDEN = {
    "eval(text)": "eval()",
    "exec(text)": "exec()",
    "compile(text, 'f', 'exec')": "compile()",
    "import pickle": "import pickle",
    "from pickle import loads": "import pickle",
    "import marshal": "import marshal",
    "import shelve": "import shelve",
    "import dill": "import dill",
    "import cloudpickle": "import cloudpickle",
    "import joblib": "import joblib",
    "pandas.read_pickle(path)": "read_pickle()",
    "np.load(path, allow_pickle=True)": "allow_pickle=True",
    "numpy.load(path, None, True)": "allow_pickle=True",
    "yaml.load(text)": "yaml.load without SafeLoader",
    "yaml.load(text, Loader=yaml.Loader)": "yaml.load without SafeLoader",
    "yaml.load_all(text, yaml.FullLoader)": "yaml.load_all without SafeLoader",
    "yaml.unsafe_load(text)": "yaml.unsafe_load",
    "yaml.full_load(text)": "yaml.full_load",
    "from yaml import UnsafeLoader": "from yaml import UnsafeLoader",
    "subprocess.run(command, shell=True)": "shell=True",
    "subprocess.Popen(command, shell=flag)": "shell=True",
    "os.system(command)": "os.system()",
    "os.popen(command)": "os.popen()",
    "from os import system": "from os import system",
    "subprocess.getoutput(command)": "subprocess.getoutput()",
    "keras.saving.load_model(path, safe_mode=False)": "safe_mode=False",
    "keras.models.load_model(path, safe_mode=unsafe)": "safe_mode=False",
    "keras.config.enable_unsafe_deserialization()": "enable_unsafe_deserialization()",
    "importlib.import_module(name)": COMPUTED_IMPORT,
    "__import__(config['module'])": COMPUTED_IMPORT,
}
ALLOWED_FORMS = [
    "np.load(path)",
    "np.load(path, allow_pickle=False)",
    "yaml.load(text, Loader=yaml.SafeLoader)",
    "yaml.safe_load(text)",
    "subprocess.run([sys.executable, '-m', 'tf_sharded'], shell=False)",
    "keras.saving.load_model(path)",
    "keras.saving.load_model(path, safe_mode=True)",
    "importlib.import_module('keras')",
    "re.compile(pattern)",
    "json.loads(text)",
]


def test_the_scan_catches_each_forbidden_pattern(tmp_path):
    # Each pattern in a file of its own inside a function, as the library's modules are read.
    for i, (code, rule) in enumerate(FORBIDDEN.items()):
        path = tmp_path / f"forbidden_{i}.py"
        path.write_text(f"def read(text, path, name, command, config, flag, unsafe):\n    {code}\n")
        assert unsafe_uses(ast.parse(path.read_text(), str(path))) == [(2, "read", rule)], code
    safe = tmp_path / "allowed.py"
    safe.write_text("\n".join(ALLOWED_FORMS) + "\n")
    assert unsafe_uses(ast.parse(safe.read_text(), str(safe))) == []


def test_shell_scripts_run_no_input_as_code():
    # The Kubernetes entry point builds TF_CONFIG from checked variables with printf; nothing it reads is run.
    scripts = sorted((ROOT / "deploy").rglob("*.sh"))
    assert scripts
    code = re.compile(r"(^|[;&|(\s])(eval|source|\.)\s|\b(ba)?sh\s+-c\b")
    for script in scripts:
        for number, line in enumerate(script.read_text().splitlines(), 1):
            text = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
            assert not code.search(text), f"{script.relative_to(ROOT)}:{number}: {line.strip()}"


def test_the_security_catalogue_names_tests_that_exist():
    page = (ROOT / "docs" / "security.md").read_text()
    section = page.split("## What the library reads from outside", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`((?:safety|[\w/]+\.py)::[\w:]+)`", section)
    assert len(named) >= 20, named
    for reference in named:
        path, *owners, test = reference.replace("safety::", "test_input_safety.py::").removeprefix("tests/").split("::")
        tree = ast.parse((ROOT / "tests" / path).read_text())
        for owner in owners:
            tree = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner)
        assert any(isinstance(n, ast.FunctionDef) and n.name == test for n in tree.body), reference


def test_a_local_clusters_imports_are_dotted_names():
    for wrong in (["os; rm -rf /"], ["tf_sharded.app.readers:load_ops()"], ["../evil"], [3]):
        with pytest.raises(ValueError, match=r"Argument `imports` must hold module names"):
            tfs.cluster.LocalCluster(num_workers=1, num_ps=1, mode="process", imports=wrong)
    ok = tfs.cluster.LocalCluster(num_workers=1, num_ps=1, mode="process", imports=["tf_sharded.app.readers:load_ops"])
    assert ok.imports == ("tf_sharded.app.readers:load_ops",)


# ----------------------------------------------------------------------------------- the refusals --


def run(main, argv):
    """`(exit code, stdout, stderr)` of a command's `main(argv)` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def train(*argv):
    from tf_sharded.app import cli

    tiny = ["--strategy", "default", "--model", "mlp", "--steps", "2", "--steps_per_epoch", "2", "--batch_size",
            "32", "--eval_steps", "1", "--verbose", "0"]  # fmt: skip
    return run(cli.main, tiny + list(argv))


def inspect(path):
    from tf_sharded.__main__ import main

    return run(main, ["inspect", path])


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def listing(directory):
    return {name: os.path.getmtime(os.path.join(directory, name)) for name in os.listdir(directory)}


@pytest.fixture(scope="module")
def ratings(tmp_path_factory):
    """A CSV of 300 ratings, its inferred schema, and a checkpoint directory a 2-step run wrote with it."""
    from tf_sharded.app import data, scan, schema

    out = tmp_path_factory.mktemp("ratings")
    csv = data.synthesize_ratings("csv", 300, str(out / "ratings"), 0)[0]
    columns, lists = scan.sample_columns(csv)
    schema_file = str(out / "ratings.schema.json")
    schema.save(schema.infer_from_columns(columns, label="rating", list_columns=lists), schema_file)
    checkpoints = str(out / "ckpt")
    code, _, err = train("--data", csv, "--schema", schema_file, "--checkpoint_dir", checkpoints)
    assert code == 0, err
    return csv, schema_file, checkpoints


def write_json(path, value):
    with open(path, "w") as f:
        f.write(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def test_a_schema_file_that_is_not_json_or_has_unknown_keys_is_one_line_naming_file_and_key(ratings, tmp_path):
    csv, schema_file, _ = ratings
    with open(schema_file) as f:
        good = json.load(f)
    cases = {
        "not JSON": ("{label: rating}", r"schema file '.*not_JSON.json' is not JSON: Expecting property name"),
        "a key the schema lacks": ({**good, "weights": "x"}, r": unknown key\(s\) \['weights'\]; a schema has"),
        "a key the label lacks": (
            {**good, "label": {**good["label"], "column": 1}},
            r": label: unknown key\(s\) \['column'\]",
        ),
        "a key the feature lacks": (
            {**good, "features": [{**good["features"][0], "colour": "red"}] + good["features"][1:]},
            r": features\[0\] \('user_id'\): unknown key\(s\) \['colour'\] for a categorical feature",
        ),
        "a mean that is not a number": (
            {**good, "features": good["features"] + [{"name": "age2", "type": "numeric", "mean": "x", "std": 1}]},
            r": features\[4\] \('age2'\): `mean` and `std` go together, with std > 0. Received: 'x', 1",
        ),
    }
    for case, (content, message) in cases.items():
        path = write_json(tmp_path / f"{case.replace(' ', '_')}.json", content)
        code, out, err = train("--data", csv, "--schema", path)
        assert code == 1, case
        line = one_line(err)
        assert re.match(r"error: " + (r"schema file " if case == "not JSON" else re.escape(path)), line), line
        assert re.search(message, line), (case, line)
        assert "training" not in out


def test_a_column_the_data_lacks_is_named_with_the_schema_file(ratings, tmp_path):
    csv, schema_file, _ = ratings
    with open(schema_file) as f:
        wrong = json.load(f)
    wrong["label"]["name"] = "stars"
    path = write_json(tmp_path / "stars.json", wrong)
    code, out, err = train("--data", csv, "--schema", path)
    assert code == 1
    assert one_line(err) == (
        f"error: --data {csv} lacks columns ['stars']; it has ['rating', 'user_id', 'movie_id', 'genres', 'age']: "
        f"--schema {path} names them"
    )


def test_data_in_no_known_format_or_in_mixed_formats_is_refused_naming_the_file(ratings, tmp_path):
    from tf_sharded.app import readers, schema

    csv, schema_file, _ = ratings
    ratings_schema = schema.load(schema_file)
    garbage = tmp_path / "day_0"
    garbage.write_bytes(bytes(range(256)) * 4)  # not text: read as TFRecord, which it is not either
    with pytest.raises(readers.InputError, match=rf"^{garbage}: not a readable TFRecord file \("):
        readers.open_source(str(garbage), ratings_schema)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.csv").write_text(pathlib.Path(csv).read_text())
    (mixed / "b.tfrecord").write_bytes(b"\x00" * 64)
    with pytest.raises(readers.InputError, match=rf"^--data: files of different formats in {mixed}: "):
        readers.open_source(str(mixed), ratings_schema)


TF_CONFIGS = {
    "not JSON": ("{cluster: 1}", "TF_CONFIG: not JSON (Expecting property name enclosed in double quotes"),
    "not an object": ("[1, 2]", "TF_CONFIG: expected a JSON object with `cluster` and `task`; received [1, 2]"),
    "no cluster": ('{"task": {"type": "worker", "index": 0}}', "TF_CONFIG: `cluster` must map each job"),
    "an address that is not text": (
        '{"cluster": {"worker": [1], "ps": ["h:2"]}, "task": {"type": "worker", "index": 0}}',
        "TF_CONFIG: `cluster` must map each job to its tasks' addresses",
    ),
    "no ps job": (
        '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}',
        "TF_CONFIG: --strategy parameter_server needs `ps` and `worker` jobs in `cluster`; received ['worker']",
    ),
    "no task": (
        '{"cluster": {"worker": ["h:1"], "ps": ["h:2"]}}',
        "TF_CONFIG: `task` must name this process's task, its `type` one of the cluster's jobs ['worker', 'ps'] "
        'under --strategy parameter_server, such as {"type": "worker", "index": 0}; received null',
    ),
    "a task type the cluster lacks": (
        '{"cluster": {"worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "chief", "index": 0}}',
        "TF_CONFIG: `task` must name this process's task",
    ),
    "an index past the job's tasks": (
        '{"cluster": {"worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "worker", "index": 1}}',
        "TF_CONFIG: `task.index` must be one of the 1 worker task(s), 0 to 0; received",
    ),
    "no index": (
        '{"cluster": {"worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "ps"}}',
        "TF_CONFIG: `task.index` must be one of the 1 ps task(s)",
    ),
}


def test_a_malformed_tf_config_is_one_line_naming_it_before_anything_starts():
    from tf_sharded.app import cli

    for case, (value, message) in TF_CONFIGS.items():
        problem = cli.tf_config_problem("parameter_server", {"TF_CONFIG": value})
        assert problem.startswith(message), (case, problem)
        assert "\n" not in problem
    good = '{"cluster": {"chief": ["h:0"], "worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "chief", "index": 0}}'
    assert cli.tf_config_problem("parameter_server", {"TF_CONFIG": good}) == ""
    assert cli.tf_config_problem("multi_worker", {"TF_CONFIG": good.replace('"ps": ["h:2"]', '"x": ["h:3"]')}) == ""
    # Strategies that do not read it leave it alone, as TensorFlow does.
    assert cli.tf_config_problem("mirrored", {"TF_CONFIG": "{cluster: 1}"}) == ""
    with mock.patch.dict(os.environ, {"TF_CONFIG": "{cluster: 1}"}):
        code, out, err = train("--strategy", "parameter_server")
    assert code == 1
    assert one_line(err).startswith("error: TF_CONFIG: not JSON (")
    assert out == ""


def test_mirrored_flags_where_they_cannot_apply_are_refused_in_one_line():
    usage = " (python -m tf_sharded train --help lists the flags)"
    cases = {
        (
            "--strategy",
            "mirrored",
            "--placement",
            "sharded",
            "--vocabulary",
            "dynamic",
        ): "error: --placement sharded with --vocabulary dynamic needs --strategy multi_worker (a shard per "
        "worker); under --strategy mirrored a dynamic table is one copy on the host",
        ("--strategy", "default", "--placement", "sharded"): "error: --placement applies to --strategy "
        "mirrored|multi_worker; received --strategy default",
        ("--strategy", "parameter_server", "--placement", "host"): "error: --placement applies to --strategy "
        "mirrored|multi_worker; received --strategy parameter_server",
        ("--cpu_replicas", "2"): "error: --cpu_replicas applies to --strategy mirrored; received --strategy default",
    }
    for argv, message in cases.items():
        code, out, err = train(*argv)
        assert (code, out, one_line(err)) == (2, "", message + usage), argv


def test_training_on_from_a_checkpoint_of_another_schema_is_refused_before_reading_data(ratings, tmp_path):
    csv, schema_file, checkpoints = ratings
    with open(schema_file) as f:
        other = json.load(f)
    buckets = other["features"][0]["buckets"]
    other["features"][0]["buckets"] = buckets * 2
    other["features"] = other["features"][:3]
    path = write_json(tmp_path / "other.json", other)
    before = listing(checkpoints)
    code, out, err = train("--data", csv, "--schema", path, "--checkpoint_dir", checkpoints)
    assert code == 1
    assert one_line(err) == (
        f"error: --schema {path}: the checkpoints in --checkpoint_dir {checkpoints} were written with another "
        f"schema ({checkpoints}/tf_sharded_schema.json): feature(s) ['age'] only in the saved schema; feature "
        f"'user_id': buckets {buckets} saved, {buckets * 2} given. Train with that schema, or write to another "
        "--checkpoint_dir."
    )
    assert out == ""  # refused before the data was read
    assert listing(checkpoints) == before  # nothing written: the saved schema is still the checkpoints'
    # Criteo's layout (no --schema) against the same directory: named as what the flags asked for.
    code, _, err = train("--data", csv, "--checkpoint_dir", checkpoints, "--max_vocab", "100")
    assert code == 1
    assert one_line(err).startswith(
        f"error: Criteo's layout (without --schema, --max_vocab): the checkpoints in --checkpoint_dir {checkpoints} "
        "were written with another schema"
    )


def test_training_on_from_a_checkpoint_of_another_model_is_one_line_and_restores_nothing(ratings):
    csv, schema_file, checkpoints = ratings
    before = listing(checkpoints)
    for flags, difference in (
        (["--embedding_dim", "8"], "(table 'embeddings/user_id'): shape ["),
        (["--optimizer", "sgd"], "in the checkpoint, not in the model"),
    ):
        code, _, err = train("--data", csv, "--schema", schema_file, "--checkpoint_dir", checkpoints, *flags)
        assert code == 1, flags
        line = one_line(err)
        assert line.startswith(
            f"error: --checkpoint_dir {checkpoints}: Cannot restore checkpoint '{checkpoints}/ckpt-2': it was "
            "written by another model ("
        ), line
        assert difference in line and "Nothing was restored." in line, line
        assert listing(checkpoints) == before


def test_inspect_refuses_what_is_not_a_checkpoint_in_one_line(ratings, tmp_path):
    *_, checkpoints = ratings
    empty = tmp_path / "empty"
    empty.mkdir()
    text = write_json(tmp_path / "notes.txt", "hello")
    damaged = tmp_path / "damaged"
    prefix = tf.train.Checkpoint(v=tf.Variable([1.0])).write(str(damaged / "ckpt"))
    index = pathlib.Path(prefix + ".index")
    index.write_bytes(index.read_bytes()[:20])
    manifest = tmp_path / "manifest"
    tf.train.Checkpoint(v=tf.Variable([1.0])).save(str(manifest / "ckpt"))
    for path, message in (
        (str(empty), f"error: inspect: no checkpoint in directory '{empty}'"),
        (text, f"error: inspect: no checkpoint at '{text}': expected a checkpoint directory or a checkpoint's prefix"),
        (str(damaged / "ckpt"), f"error: inspect: '{prefix}' is not a readable checkpoint: file is too short"),
    ):
        code, _, err = inspect(path)
        assert code == 1 and one_line(err).startswith(message), err
    layout = manifest / "tf_sharded_layout.json"
    for content, message in (
        ("{tables", "expected the layout manifest tfs.fit writes (JSON), received: Expecting property name"),
        ('{"tables": [1]}', 'expected the layout manifest tfs.fit writes, {"tables": {checkpoint key: {"table",'),
        ('{"tables": {"k": {"table": 1}}}', "expected the layout manifest tfs.fit writes"),
    ):
        layout.write_text(content)
        code, _, err = inspect(str(manifest))
        assert code == 1 and one_line(err).startswith(f"error: inspect: {layout}: {message}"), err
    code, out, _ = inspect(checkpoints)  # what the application wrote reads
    assert code == 0 and "embeddings" in out


def test_key_files_of_another_table_or_damaged_are_refused_and_load_nothing():
    strings = tfs.layers.DynamicEmbedding(4, key_dtype="string", seed=0, name="string_keys")
    ints = tfs.layers.DynamicEmbedding(4, seed=0, name="int_keys")
    strings(tf.constant([["a"], ["bc"]]))
    ints(tf.constant([[5], [6], [7]], tf.int64))
    string_file, int_file = {}, {}
    strings.save_own_variables(string_file)
    ints.save_own_variables(int_file)
    for layer, store, error, message in (
        (ints, string_file, TypeError, "Layer 'int_keys': the table has key_dtype=int64; entry 'keys' holds string"),
        (strings, int_file, TypeError, "Layer 'string_keys': the table has key_dtype=string; entry 'keys' holds int64"),
        (
            strings,
            {**string_file, "keys_lengths": np.array([1, 5])},
            ValueError,
            "Layer 'string_keys': entry 'keys_lengths' does not describe the 3 bytes of 'keys'",
        ),
        (
            strings,
            {**string_file, "keys_lengths": np.array([-1, 4])},
            ValueError,
            "entry 'keys_lengths' does not describe",
        ),
        (
            ints,
            {**int_file, "values": int_file["values"][:2]},
            ValueError,
            r"Dynamic table 'int_keys': the keys to load must be one per row of values. Received keys of "
            r"shape \[3\] and rows of shape \[2, 4\]",
        ),
        (ints, {"values": int_file["values"]}, ValueError, "Layer 'int_keys': the saved file has no 'keys' and"),
    ):
        before = sorted(layer.table.export()[0].numpy().tolist())
        with pytest.raises(error, match=message):
            layer.load_own_variables(store)
        assert sorted(layer.table.export()[0].numpy().tolist()) == before
    strings.load_own_variables(string_file)  # its own file loads
    assert sorted(strings.table.export()[0].numpy().tolist()) == [b"a", b"bc"]
