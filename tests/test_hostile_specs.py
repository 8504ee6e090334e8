"""Hostile specs: each refused before anything exists, in a short message (< 4 KB) naming the field and the fix."""

import math
import shutil
import socket
import subprocess

import pytest

from gpuflow.cluster.spec import ExperimentSpec, SpecError, check_spec, load_spec, parse_spec
from gpuflow.flows.cli import main as gpuflow
from tests.support.repo import A_LOOP, DIGITS_DATA, REPO, with_loop
from tests.support.servers import not_http_server

MAX_MESSAGE_BYTES = 4096
HUGE = "x" * 100_000

HOSTILE_SPECS = [
    # (fields, field named in the message, a word of the fix or the value)
    # booleans and strings where numbers belong: not silently 1, 0 or 10
    ({"train": {"epochs": True}}, "train.epochs", "not a boolean"),
    ({"train": {"batch_size": False}}, "train.batch_size", "not a boolean"),
    ({"train": {"lr": True}}, "train.lr", "not a boolean"),
    ({"compute": {"num_nodes": True}}, "compute.num_nodes", "not a boolean"),
    ({"compute": {"workers_per_node": True}}, "compute.workers_per_node", "not a boolean"),
    ({"storage": {"num_to_keep": True}}, "storage.num_to_keep", "not a boolean"),
    ({"limits": {"max_runtime_minutes": "15"}}, "limits.max_runtime_minutes", "'15'"),
    ({"train": {"epochs": 2.0}}, "train.epochs", "2.0"),
    ({"compute": {"use_spot": "no"}}, "compute.use_spot", "'no'"),
    # non-finite and absurd numbers
    ({"train": {"lr": math.inf}}, "train.lr", "finite"),
    ({"train": {"lr": math.nan}}, "train.lr", "finite"),
    ({"limits": {"max_runtime_minutes": 1e308}}, "limits.max_runtime_minutes", "less than or equal to 43200"),
    ({"limits": {"max_cost_usd": math.inf}}, "limits.max_cost_usd", "finite"),
    ({"limits": {"hourly_rate_usd": math.nan}}, "limits.hourly_rate_usd", "finite"),
    ({"limits": {"idle_gpu_minutes": -math.inf}}, "limits.idle_gpu_minutes", "finite"),
    ({"limits": {"min_gpu_utilization": math.nan}}, "limits.min_gpu_utilization", "finite"),
    ({"limits": {"idle_minutes_to_autostop": 10**9}}, "limits.idle_minutes_to_autostop", "lower it"),
    ({"train": {"epochs": 10**12}}, "train.epochs", "lower it"),
    ({"train": {"lr": 1e9}}, "train.lr", "lower it"),
    ({"compute": {"cpus_per_worker": 1e6}}, "compute.cpus_per_worker", "lower it"),
    ({"compute": {"backend": "skypilot", "memory_gb_per_node": math.inf}}, "compute.memory_gb_per_node", "finite"),
    ({"compute": {"backend": "skypilot", "disk_size_gb": 10**9}}, "compute.disk_size_gb", "lower it"),
    ({"compute": {"max_hourly_cost_usd": math.inf}}, "compute.max_hourly_cost_usd", "finite"),
    ({"train": {"params": {"dropout": math.nan}}}, "train.params", "finite"),
    # locations: unknown schemes, no host, credentials inside, control characters
    ({"tracking": {"uri": "ftp://nowhere"}}, "tracking.uri", "http(s)://host:port"),
    ({"tracking": {"uri": "javascript:alert(1)"}}, "tracking.uri", "javascript://"),
    ({"tracking": {"uri": "http://"}}, "tracking.uri", "no host"),
    ({"tracking": {"uri": "https://alice:hunter2@mlflow.example.com"}}, "tracking.uri", "MLFLOW_TRACKING_PASSWORD"),
    ({"storage": {"checkpoints": "ftp://host/ckpt"}}, "storage.checkpoints", "s3://"),
    ({"data": {"train": "gopher://host/train.parquet"}}, "data.train", "bucket URI"),
    ({"workdir": "/tmp/\x00evil"}, "workdir", "control characters"),
    # credentials in envs, and names that are not environment variables
    ({"envs": {"WANDB_API_KEY": "sk-123"}}, "envs", "move it to secrets"),
    ({"envs": {"AWS_SECRET_ACCESS_KEY": "abc"}}, "envs", "move it to secrets"),
    ({"envs": {"HF_TOKEN": "hf_abc"}}, "envs", "move it to secrets"),
    ({"envs": {"DB_PASSWORD": "pw"}}, "envs", "move it to secrets"),
    ({"envs": {"1BAD NAME": "x"}}, "envs", "not an environment variable name"),
    ({"envs": {"GPUFLOW_MLFLOW_RUN_ID": "other-run"}}, "envs", "set by gpuflow"),
    ({"envs": {"PROJECT": 7}}, "envs.PROJECT", "valid string"),
    ({"secrets": ["not a name; rm -rf /"]}, "secrets.0", "not an environment variable name"),
    # credentials in train.params: logged to MLflow in clear
    ({"train": {"params": {"db_password": "pw"}}}, "train.params.db_password", "secrets: [DB_PASSWORD]"),
    ({"train": {"params": {"wandbApiKey": "k"}}}, "train.params.wandbApiKey", "secrets: [WANDB_API_KEY]"),
    ({"train": {"params": {"API_KEY": "k"}}}, "train.params.API_KEY", "os.environ['API_KEY']"),
    ({"train": {"params": {"token": "t"}}}, "train.params.token", "secrets: [TOKEN]"),
    ({"train": {"params": {"Secret": "s"}}}, "train.params.Secret", "secrets: [SECRET]"),
    (
        {"train": {"params": {"s3": {"aws_secret_access_key": "s"}}}},
        "train.params.s3.aws_secret_access_key",
        "secrets: [AWS_SECRET_ACCESS_KEY]",
    ),
    # sizes: long values are shortened, floods are cut
    ({"name": HUGE}, "name", "chars)"),
    ({"setup": HUGE}, "setup", "at most 20000"),
    ({HUGE: 1}, "spec", "unknown field"),
    ({"envs": {f"V{i}": "x" for i in range(500)}}, "envs", "at most 200"),
    ({"train": {"params": {f"p{i}": i for i in range(10_000)}}}, "spec", "more than 5000 values"),
    ({"train": {"params": {"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}}}, "spec", "nested deeper"),
    ({f"field{i}": i for i in range(50)}, "more problems", "fix these first"),
]


@pytest.mark.parametrize(
    "fields, field, fix", HOSTILE_SPECS, ids=[f"{b[1][:30]}-{i}" for i, b in enumerate(HOSTILE_SPECS)]
)
def test_hostile_spec_is_refused_briefly_naming_field_and_fix(fields, field, fix):
    with pytest.raises(SpecError) as error:
        parse_spec(with_loop(fields))
    message = str(error.value)
    assert field in message and fix in message, message
    assert len(message.encode()) < MAX_MESSAGE_BYTES, len(message)


def test_hyper_parameters_that_only_sound_like_credentials_pass():
    params = {
        "tokenizer": "bpe",
        "max_tokens": 512,
        "num_tokens": 10,
        "secretary": 1,
        "pad_token": "<pad>",
        "eos_token_id": 2,
        "label_key": "y",
        "forward_pass": 2,
        "password_file": "pw.txt",
    }
    assert parse_spec(with_loop({"train": {"params": params}})).train.params == params


def test_epochs_true_is_not_one():
    with pytest.raises(SpecError, match="train.epochs"):
        parse_spec(with_loop({"train": {"epochs": True}}))
    assert parse_spec(with_loop({"train": {"epochs": 3, "lr": 1}})).train.lr == 1.0  # an int is still a fine float


BILLION_LAUGHS = "\n".join(
    ["name: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"l{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 8)]
    + ["train: {params: {bomb: *a7}}"]
)


def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, capsys):
    bomb = tmp_path / "laughs.yaml"
    bomb.write_text(BILLION_LAUGHS)
    assert gpuflow(["validate", str(bomb)]) == 2
    err = capsys.readouterr().err
    assert "more than 5000 values" in err and "aliases" in err, err[:500]
    assert len(err.encode()) < MAX_MESSAGE_BYTES


def test_recursive_alias_is_refused(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("train: {params: &p {self: *p}}\n")
    with pytest.raises(SpecError, match="nested deeper"):
        load_spec(loop)


def test_oversized_spec_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: digits-mlp\n" + "# padding\n" * 50_000)
    with pytest.raises(SpecError, match="bytes, more than a spec can be"):
        load_spec(big)


@pytest.mark.parametrize(
    "text, field, lines",
    [
        ("train:\n  loop: experiments.digits:train_loop\n  epochs: 3\n  epochs: 30\n", "train.epochs", "lines 3 and 4"),
        (
            "train: {loop: experiments.digits:train_loop}\nname: a\ntrain: {loop: os:system}\n",
            "train:",
            "lines 1 and 3",
        ),
        (
            "train:\n  loop: experiments.digits:train_loop\n  params: {hidden: 8, hidden: 9}\n",
            "train.params.hidden",
            "lines 3 and 3",
        ),
    ],
)
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, capsys, text, field, lines):
    spec = tmp_path / "twice.yaml"
    spec.write_text(text)
    assert gpuflow(["validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{field}" in err and "given twice" in err and lines in err and "keep one" in err, err


def test_a_merge_key_may_still_override_what_it_merges(tmp_path):
    spec = tmp_path / "merged.yaml"
    spec.write_text(
        "train:\n  loop: experiments.digits:train_loop\n  params:\n"
        "    small: &small {hidden: 8, dropout: 0.1}\n    large: {<<: *small, hidden: 256}\n"
    )
    assert load_spec(spec).train.params["large"] == {"hidden": 256, "dropout": 0.1}


def test_a_deployment_spec_with_a_key_given_twice_is_refused(tmp_path):
    from gpuflow.flows.deployments.deploy import declared

    prefect_yaml = tmp_path / "prefect.yaml"
    prefect_yaml.write_text(
        "deployments:\n- name: d\n  parameters:\n    spec:\n      train: {loop: a:b, lr: 0.1, lr: 1}\n"
    )
    with pytest.raises(SpecError, match=r"deployments\.0\.parameters\.spec\.train\.lr: given twice .*lines 5 and 5"):
        declared(prefect_yaml)


def test_a_spec_file_with_deployment_is_refused_before_anything_is_triggered(capsys, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing answers: a trigger would fail otherwise
    assert gpuflow(["run", "experiments/digits.yaml", "--deployment", "run-experiment/run-experiment"]) == 2
    refusal = capsys.readouterr().err
    assert "--deployment runs the deployment's own spec, not experiments/digits.yaml" in refusal, refusal
    assert "gpuflow run experiments/digits.yaml" in refusal


def test_refused_credentials_are_not_called_a_bad_spec():
    from gpuflow.cluster.spec.loading import Denied, Refusal

    refused = Refusal("tracking.uri: the MLflow server at http://x refused user 'bob' (401): ...")
    assert str(SpecError([refused])).startswith("credentials refused (the spec is fine):\n  - tracking.uri: ")
    denied = Denied("tracking.experiment: MLflow user 'carol' has READ on experiment 'digits-mlp' at http://x; ...")
    assert str(SpecError([denied])).startswith("permission refused (the spec is fine):\n  - tracking.experiment: ")
    # with a problem of the spec's own, the spec is what is wrong first
    assert str(SpecError(["train.lr: -1 is below 0", refused])).startswith("invalid experiment spec:")


def test_bad_override_yaml_is_a_short_error():
    with pytest.raises(SpecError, match=r"--set .*not valid YAML"):
        load_spec(REPO / "experiments" / "digits.yaml", ["train.params={unclosed: [1"])


# -- checks beyond the model: signatures, storage, tracking server ------------------------------------


def checked(fields):
    return check_spec(parse_spec(with_loop({"workdir": str(REPO), "data": DIGITS_DATA, **fields})))


@pytest.mark.parametrize(
    "fields, field, fix",
    [
        ({"train": {"loop": "experiments.digits:write_parquet"}}, "train.loop", "def train_loop(config: dict)"),
        (
            {"data": {**DIGITS_DATA, "generate": "experiments.digits:train_loop"}},
            "data.generate",
            "train_uri, validation_uri",
        ),
        ({"storage": {"checkpoints": "/etc/hostname/checkpoints"}}, "storage.checkpoints", "cannot write"),
        ({"storage": {"checkpoints": "file:///proc/gpuflow-checkpoints"}}, "storage.checkpoints", "cannot write"),
    ],
)
def test_checks_refuse_what_cannot_run(fields, field, fix, gpuflow_home):
    problems = checked(fields)
    assert any(p.startswith(field) and fix in p for p in problems), problems


def test_storage_probe_leaves_nothing_behind(tmp_path, gpuflow_home):
    folder = tmp_path / "ckpt"
    assert checked({"storage": {"checkpoints": f"file://{folder}"}}) == []
    assert folder.is_dir() and list(folder.iterdir()) == []


@pytest.fixture
def immutable_folder(tmp_path):
    """A folder not even root can write in (chattr +i), made writable again after the test."""
    folder = tmp_path / "immutable"
    folder.mkdir()
    if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("chattr +i does not work on this file system")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_checkpoint_folder_root_cannot_write_is_refused(immutable_folder, gpuflow_home):
    # os.access says yes to root for a kernel file system; only a write tells
    for folder in ("/sys/gpuflow-checkpoints/run", immutable_folder / "run", immutable_folder):
        problems = checked({"storage": {"checkpoints": str(folder)}})
        assert any(
            p.startswith("storage.checkpoints: cannot write under")
            and "Operation not permitted" in p
            and "give a folder or bucket this machine can write" in p
            for p in problems
        ), problems


def test_the_local_storage_probe_leaves_no_folder(tmp_path, gpuflow_home):
    assert checked({"storage": {"checkpoints": str(tmp_path / "made" / "ckpt")}}) == []
    assert not (tmp_path / "made").exists() and not list(tmp_path.glob(".gpuflow-write-probe-*"))


@pytest.mark.parametrize(
    "field, entrypoint",
    [
        ("train.loop", "builtins:print"),
        ("train.loop", "os:getcwd"),
        ("train.loop", "math:floor"),
        ("train.loop", "operator:itemgetter"),
        ("train.loop", "os:system"),
        ("data.generate", "builtins:print"),
    ],
)
def test_a_builtin_is_no_entrypoint(tmp_path, field, entrypoint):
    module = "own_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name)
    (tmp_path / f"{module}.py").write_text(
        "def train_loop(config):\n    pass\n\n\ndef write(train, validation):\n    pass\n"
    )
    spec = {
        "train": {"loop": f"{module}:train_loop"},
        "data": {"train": "t.parquet", "generate": f"{module}:write"},
        "workdir": str(tmp_path),
    }
    section, key = field.split(".")
    spec[section][key] = entrypoint
    problems = check_spec(parse_spec(spec))
    assert len(problems) == 1 and problems[0].startswith(f"{field}: {entrypoint!r} is a"), problems
    assert "not a Python function; give 'module:function'" in problems[0] and "def " in problems[0], problems


def test_tracking_server_that_is_down_is_a_clear_error(gpuflow_home):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    problems = checked({"tracking": {"uri": f"http://127.0.0.1:{port}"}})
    assert any(p.startswith("tracking.uri") and "does not answer" in p for p in problems), problems


def test_a_run_waits_for_a_tracking_server_that_comes_back_and_one_that_does_not_is_refused(gpuflow_home):
    """A flow run nobody watches (a schedule, the UI) outlives a restart of its tracking server: it waits, saying
    so, and goes on once the server answers; one still down after the wait is refused as before."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gpuflow.cluster.spec.probes import wait_for_tracking_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri, said = f"http://127.0.0.1:{port}", []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    servers = []

    def come_back():
        servers.append(ThreadingHTTPServer(("127.0.0.1", port), Health))
        threading.Thread(target=servers[0].serve_forever, daemon=True).start()

    back = threading.Timer(3, come_back)
    back.start()
    try:
        started = time.monotonic()
        wait_for_tracking_server(uri, said.append, bound_s=60)
        assert servers and time.monotonic() - started < 30, "it went on once the server was back"
        assert said[0].startswith(f"the MLflow server at '{uri}' does not answer") and "waiting 60 s" in said[0]
        assert said[-1] == f"the MLflow server at '{uri}' answers again" and len(said) == 2, said
    finally:
        back.cancel()
        for server in servers:
            server.shutdown()
            server.server_close()

    said.clear()
    started = time.monotonic()
    wait_for_tracking_server(uri, said.append, bound_s=1)
    assert time.monotonic() - started < 1 + 10 and len(said) == 1, said
    assert any(p.startswith("tracking.uri") and "does not answer" in p for p in checked({"tracking": {"uri": uri}}))


def test_a_run_outlives_its_tracking_server_killed_between_the_checks(gpuflow_home):
    """The server answers its health probe, then dies as its users are asked (a kill -9 at the wrong moment), and
    comes back 2 s later: a run nobody watches waits and checks again; a person is told in a line, no traceback."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gpuflow.cluster.spec import validate_spec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    servers, dying = [], threading.Event()

    class DiesWhenAsked(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/api/2.0/mlflow/users/current") and dying.is_set():
                dying.clear()
                self.close_connection = True  # no answer: the process died with the request open
                threading.Thread(target=restart, args=(servers[-1],)).start()
                return
            self.send_response(200 if self.path == "/health" else 404)  # 404: no users on this server
            self.end_headers()

        def log_message(self, *args):
            pass

    def serve():
        servers.append(ThreadingHTTPServer(("127.0.0.1", port), DiesWhenAsked))
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()

    def restart(server):
        server.shutdown()
        server.server_close()
        threading.Event().wait(2)
        serve()

    uri = f"http://127.0.0.1:{port}"
    spec = parse_spec(with_loop({"workdir": str(REPO), "data": DIGITS_DATA, "tracking": {"uri": uri}}))
    serve()
    try:
        dying.set()
        with pytest.raises(SpecError) as refused:
            validate_spec(spec)  # a person at `gpuflow run`: told at once
        assert f"tracking.uri: the MLflow server at '{uri}' does not answer" in str(refused.value), refused.value
        while len(servers) < 2:
            threading.Event().wait(0.1)

        said = []
        dying.set()
        assert validate_spec(spec, patience_s=60, say=said.append) is spec  # a run nobody watches: waits, goes on
        assert len(servers) == 3 and "does not answer" in said[0] and said[-1].endswith("answers again"), said
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_tracking_uri_of_a_server_that_is_not_http_is_a_clear_error(gpuflow_home):
    with not_http_server() as port:  # as Ray's gRPC servers are
        problems = checked({"tracking": {"uri": f"http://127.0.0.1:{port}"}})
    assert any(p.startswith("tracking.uri") and "not an HTTP server" in p for p in problems), problems


@pytest.mark.full
def test_tracking_server_that_answers_passes(mlflow_url, gpuflow_home):
    assert checked({"tracking": {"uri": mlflow_url}}) == []


def test_every_default_still_validates():
    spec = ExperimentSpec.model_validate(A_LOOP)
    assert spec.train.epochs == 10 and spec.limits.max_runtime_minutes == 60
