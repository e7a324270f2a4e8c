"""docker/ and ops/: the files parse, and everything they name exists in the code: kvstream
subcommands and their options, ``KVSTREAM_*`` settings, compose services and ports,
Prometheus metrics and labels. No Docker engine is needed (none runs on the development
machines): what the engine does with these files is tested by tests/docker, in .ci/run's
Docker lane."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from kvstream.cli import cli
from kvstream.replica.metrics import ReplicaMetrics
from kvstream.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT_SCRIPT = ROOT / "docker" / "entrypoint.sh"
KAFKA_SCRIPT = ROOT / "docker" / "kafka" / "kafka.sh"
#: The images' entrypoint (docker/entrypoint.sh) ends in ``exec kvstream "$@"``.
ENTRYPOINT = "kvstream-entrypoint"
#: kvstream images (ops/docker/build.sh) → their stage of the Dockerfile.
IMAGE_TARGETS = {"kvstream-router:dev": "router", "kvstream-worker:dev": "worker"}
COMPOSE = ROOT / "docker" / "compose.yaml"
PROMETHEUS = ROOT / "ops" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "ops" / "grafana" / "kvstream-dashboard.json"
GRAFANA_PROVISIONING = ROOT / "ops" / "grafana" / "provisioning"

#: What the dashboard must show (issue 5 §6): one metric at least for each.
REQUIRED_ON_DASHBOARD = {
    "kvstream_events_applied_total",
    "kvstream_events_rejected",
    "kvstream_dlq_records_total",
    "kvstream_partition_lag",
    "kvstream_snapshot_age_seconds",
    "kvstream_snapshot_duration_seconds",
    "kvstream_route_latency_seconds_bucket",
    "kvstream_worker_events_acked_total",
    "kvstream_worker_delivery_failures_total",
    "kvstream_worker_queue_depth",
    "kvstream_worker_engine_gaps_total",
}
#: Series Prometheus makes itself, and labels it adds to every scraped series.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"instance", "job"}


# --- the files -------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@dataclass
class Stage:
    name: str
    base: str
    env: dict[str, str] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    healthcheck: str | None = None
    copies_from: list[str] = field(default_factory=list)


def dockerfile_stages() -> dict[str, Stage]:
    """The Dockerfile's stages by name; ENV, ENTRYPOINT and CMD are inherited from ``FROM
    <stage>`` as Docker does. Only the exec (JSON) form of ENTRYPOINT/CMD is accepted."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.fullmatch(r"(?:--\S+\s+)*(\S+)\s+AS\s+(\S+)", rest, flags=re.IGNORECASE)
            assert m, f"every FROM names its stage: {line!r}"
            base, name = m.groups()
            parent = stages.get(base)
            stage = Stage(name, base)
            if parent is not None:
                stage.env = dict(parent.env)
                stage.entrypoint, stage.cmd = parent.entrypoint, parent.cmd
                stage.healthcheck = parent.healthcheck
            stages[name] = stage
        elif stage is None:
            assert instr == "ARG", f"only ARG may come before the first FROM: {line!r}"
        elif instr == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"ENV uses KEY=VALUE: {item!r}"
                stage.env[key] = value
        elif instr == "RUN":
            stage.runs.append(rest)
        elif instr == "HEALTHCHECK":
            stage.healthcheck = rest
        elif instr == "COPY" and (m := re.match(r"--from=(\S+)", rest)):
            stage.copies_from.append(m.group(1))
        elif instr in ("ENTRYPOINT", "CMD"):
            value = json.loads(rest)
            assert isinstance(value, list), f"{instr} uses the exec form: {line!r}"
            if instr == "ENTRYPOINT":
                stage.entrypoint = value
            else:
                stage.cmd = value
    return stages


def kvstream_services(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Compose services that run a kvstream image (built from docker/Dockerfile)."""
    return {name: svc for name, svc in spec["services"].items() if svc.get("image") in IMAGE_TARGETS}


def image_target(svc: dict[str, Any]) -> str:
    """The Dockerfile stage of a kvstream service's image."""
    return IMAGE_TARGETS[svc["image"]]


def image_argv(stage: Stage, command: list[str] | None) -> list[str]:
    """What the container runs: ENTRYPOINT + (compose's command or the image's CMD)."""
    assert stage.entrypoint == [ENTRYPOINT], stage.entrypoint
    assert ENTRYPOINT_SCRIPT.read_text().rstrip().endswith('exec kvstream "$@"')
    return ["kvstream"] + (command if command is not None else stage.cmd or [])


def parse_kvstream(argv: list[str]) -> click.Context:
    """Parse ``kvstream ...`` exactly as the CLI would (options, types, choices, required
    ones), without running the command. Raises click's usage errors."""
    assert argv and argv[0] == "kvstream", f"not a kvstream command: {argv}"
    ctx = click.Context(cli, info_name="kvstream")
    cmd: click.Command = cli
    rest = argv[1:]
    while isinstance(cmd, click.Group):
        assert rest and not rest[0].startswith("-"), f"{argv}: expected a subcommand of {ctx.command_path}"
        name, rest = rest[0], rest[1:]
        assert name in cmd.list_commands(ctx), f"`kvstream --help` lists no {name!r} ({ctx.command_path})"
        sub = cmd.get_command(ctx, name)
        assert sub is not None
        cmd = sub
        ctx = click.Context(cmd, info_name=name, parent=ctx)
    try:
        return cmd.make_context(ctx.info_name, list(rest), parent=ctx.parent)
    except click.exceptions.Exit as exc:  # --help: parsed, printed, exits 0
        assert exc.exit_code == 0
        return ctx


# --- Dockerfile ------------------------------------------------------------------------


def test_dockerfile_stages_and_entrypoint():
    stages = dockerfile_stages()
    assert {"base", "router-deps", "router", "worker-deps", "worker"} <= stages.keys()
    assert stages["router"].base == stages["worker"].base == "base"
    # The images get the installed environment, not the dependencies' wheels.
    assert stages["router"].copies_from == ["router-deps"]
    assert stages["worker"].copies_from == ["worker-deps"]
    # The router's default command is a replica that the compose file also runs.
    ctx = parse_kvstream(image_argv(stages["router"], None))
    assert ctx.command.name == "router"
    parse_kvstream(image_argv(stages["worker"], None))


def test_only_the_worker_image_installs_torch():
    stages = dockerfile_stages()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("torch") for dep in project["dependencies"])
    assert any(dep.startswith("torch") for dep in project["optional-dependencies"]["worker"])
    # The worker's dependencies (the extra's wheels, downloaded by ops/docker/build.sh) are
    # installed on top of the router's, in a stage the router never builds on.
    router_path = [stages["base"], stages["router-deps"], stages["router"]]
    assert not any("worker" in r for st in router_path for r in st.runs)
    assert stages["worker-deps"].base == "router-deps"
    assert any("worker-deps" in r for r in stages["worker-deps"].runs)
    assert '"$wheel[worker]"' in (ROOT / "ops" / "docker" / "build.sh").read_text()


def test_router_commands_do_not_import_torch():
    """The router image has no torch: its commands must run without importing it."""
    spec = compose()
    stages = dockerfile_stages()
    argvs = [
        image_argv(stages["router"], svc.get("command"))
        for svc in kvstream_services(spec).values()
        if image_target(svc) == "router"
    ]
    code = (
        "import sys\n"
        "from tests.ops.test_ops_files import parse_kvstream\n"
        f"for argv in {argvs!r}:\n"
        "    parse_kvstream(argv)\n"
        "assert 'torch' not in sys.modules, 'a router command imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# --- compose ---------------------------------------------------------------------------


#: The emulated fleet of the `fleet` profile.
FLEET = ("engine-1", "engine-2", "bridge-1", "bridge-2")


def test_compose_names_the_services():
    spec = compose()
    assert set(spec["services"]) == {
        "kafka", "topics", "router-1", "router-2", "worker-1", "worker-2", "prometheus", "grafana",
        *FLEET,
    }
    services = spec["services"]
    # kvstream's Kafka image, of the local broker's version; a single KRaft node that
    # creates no topic by itself.
    version = subprocess.run(
        ["bash", str(ROOT / "ops" / "kafka" / "broker.sh"), "version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert services["kafka"]["image"] == f"kvstream-kafka:{version}"
    kafka_sh = KAFKA_SCRIPT.read_text()
    assert "process.roles=broker,controller" in kafka_sh and "auto.create.topics.enable=false" in kafka_sh
    assert not any(k.startswith("KAFKA_AUTO_CREATE") for k in services["kafka"]["environment"])
    # Prometheus and Grafana come from a registry: only with the monitoring profile.
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    # The emulated fleet only with the fleet profile; the rest always.
    assert all(services[name]["profiles"] == ["fleet"] for name in FLEET)
    assert not any("profiles" in svc for name, svc in kvstream_services(spec).items() if name not in FLEET)
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in ("router-1", "worker-1", "worker-2"):
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"


def test_compose_commands_parse_with_the_cli():
    spec = compose()
    stages = dockerfile_stages()
    seen = {}
    for name, svc in kvstream_services(spec).items():
        ctx = parse_kvstream(image_argv(stages[image_target(svc)], svc.get("command")))
        seen[name] = ctx
    assert seen["topics"].command_path.endswith("topics create")
    assert {seen[n].command.name for n in ("router-1", "router-2")} == {"router"}
    workers = [seen[n] for n in ("worker-1", "worker-2")]
    assert {w.command.name for w in workers} == {"worker"}
    assert len({w.params["worker_id"] for w in workers}) == 2, "each worker needs its own id"
    engines = [seen[n] for n in ("engine-1", "engine-2")]
    assert {e.command.name for e in engines} == {"emulate"}
    bridges = [seen[n] for n in ("bridge-1", "bridge-2")]
    assert {b.params["engine"] for b in bridges} == {"vllm"}
    ids = {w.params["worker_id"] for w in workers + bridges}
    assert len(ids) == 4, "each worker and bridge needs its own id"
    # Each bridge reads its own engine's events and registers that engine's URL.
    for i, bridge in enumerate(bridges, 1):
        assert bridge.params["engine_url"] == f"http://engine-{i}:{engines[i - 1].params['port']}"
        assert all(f"//engine-{i}:" in e for e in bridge.params["endpoints"] + bridge.params["replay_endpoints"])


def test_routers_have_their_own_snapshots_and_a_readiness_check():
    spec = compose()
    services = spec["services"]
    port = dockerfile_stages()["router"].env["KVSTREAM_REPLICA__PORT"]
    snapshot_dir = dockerfile_stages()["router"].env["KVSTREAM_REPLICA__SNAPSHOT_DIR"]
    volumes = []
    for name in ("router-1", "router-2"):
        # The image's health check (docker/entrypoint.sh health) polls /readyz.
        assert "healthcheck" not in services[name]
        [volume] = services[name]["volumes"]
        source, target = volume.split(":")
        assert target == snapshot_dir and source in spec["volumes"]
        volumes.append(source)
    assert len(set(volumes)) == 2
    assert '"kvstream-entrypoint", "health", "KVSTREAM_REPLICA__PORT", "/readyz"' in (
        dockerfile_stages()["router"].healthcheck or ""
    )
    # The second replica starts from the first's snapshot, once the first is ready.
    argv = services["router-2"]["command"]
    assert argv[argv.index("--peer") + 1] == f"http://router-1:{port}"
    assert services["router-2"]["depends_on"]["router-1"]["condition"] == "service_healthy"


def kvstream_env() -> list[tuple[str, str, str]]:
    """(where, name, value) of every KVSTREAM_* variable the Dockerfile or compose sets,
    each name and value once (``where`` is the first place that sets it)."""
    found: dict[tuple[str, str], str] = {}
    for stage in dockerfile_stages().values():
        for key, value in stage.env.items():
            found.setdefault((key, value), f"Dockerfile stage {stage.name}")
    for name, svc in compose()["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            found.setdefault((key, str(value)), f"compose service {name}")
    return [(where, key, value) for (key, value), where in found.items() if key.startswith("KVSTREAM_")]


@pytest.mark.parametrize("where,name,value", kvstream_env())
def test_kvstream_env_vars_are_settings(monkeypatch, where, name, value):
    """Each variable names a settings field (nested with ``__``) and the value loads."""
    monkeypatch.setenv(name, value)
    settings = load_settings()
    node: Any = settings
    for part in name.removeprefix("KVSTREAM_").lower().split("__"):
        fields = type(node).model_fields
        assert part in fields, f"{where}: {name} is not a setting ({type(node).__name__} has no {part!r})"
        node = getattr(node, part)
    assert str(node) == value, f"{where}: {name}={value!r} loaded as {node!r}"


# --- Prometheus and Grafana ------------------------------------------------------------


@dataclass(frozen=True)
class Exposed:
    """Series names a metric family exposes, and its labels."""

    series: frozenset[str]
    labels: frozenset[str]


def exposed(name: str, kind: str, labels: frozenset[str]) -> Exposed:
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}[kind]
    extra = {"le"} if kind == "histogram" else set()
    return Exposed(frozenset(name + s for s in suffixes), labels | extra)


def replica_metrics() -> list[Exposed]:
    out = []
    for metric in vars(ReplicaMetrics()).values():
        if isinstance(metric, MetricWrapperBase):
            # prometheus_client keeps the declared label names here; a labelled family
            # with no child yet exposes no sample to read them from.
            out.append(exposed(metric._name, metric._type, frozenset(metric._labelnames)))
    assert out
    return out


@pytest.fixture
def worker_metrics(kafka_topics: Settings) -> Iterator[list[Exposed]]:
    """The families of a real worker collector (publisher on the test broker, consolidator,
    ZMQ bridge: all of them, so that the engine metrics are there too)."""
    from kvstream.worker.consolidator import Consolidator
    from kvstream.worker.metrics import WorkerCollector
    from kvstream.worker.publisher import KafkaPublisher, PublisherOptions
    from kvstream.worker.zmq_bridge import BridgeOptions, Endpoint, ZmqEngineBridge

    publisher = KafkaPublisher(kafka_topics, PublisherOptions(worker_id=7))
    try:
        consolidator = Consolidator(publisher)
        bridge = ZmqEngineBridge(BridgeOptions((Endpoint("tcp://127.0.0.1:1"),)), consolidator)
        families = list(WorkerCollector(publisher, consolidator, bridge).collect())
    finally:
        publisher.close()
    yield [
        exposed(f.name, f.type, frozenset(label for s in f.samples for label in s.labels))
        for f in families
    ]


def dashboard_targets() -> Iterator[tuple[str, dict[str, Any]]]:
    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
        for panel in panels:
            yield from walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                yield panel["title"], target

    yield from walk(json.loads(DASHBOARD.read_text())["panels"])


#: PromQL words that look like series names.
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def referenced(expr: str) -> tuple[set[str], set[str]]:
    """(series names, label names) a PromQL expression uses."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels: set[str] = set()
    grouping = r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)"
    for group in re.findall(grouping, s):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    s = re.sub(grouping, " ", s)
    for selector in re.findall(r"\{([^}]*)\}", s):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
    s = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", s)
    # What is left: functions (followed by "("), numbers, operators and series names.
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", s)) - PROMQL_KEYWORDS
    return names, labels


def test_promql_reference_extraction():
    names, labels = referenced(
        'histogram_quantile(0.9, sum by (le, instance) (rate(kvstream_route_latency_seconds_bucket[5m])))'
        ' + up{job=~"kvstream-.*"} + kvstream_snapshot_age_seconds'
    )
    assert names == {"kvstream_route_latency_seconds_bucket", "up", "kvstream_snapshot_age_seconds"}
    assert labels == {"le", "instance", "job"}


def test_dashboard_uses_only_real_metrics_and_labels(worker_metrics):
    families = replica_metrics() + worker_metrics
    known = {series: fam for fam in families for series in fam.series}
    dashboard = json.loads(DASHBOARD.read_text())
    datasource_uid = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ][0]["uid"]
    used: set[str] = set()
    problems = []
    for title, target in dashboard_targets():
        assert target["datasource"]["uid"] == datasource_uid, title
        names, labels = referenced(target["expr"])
        names = {n for n in names if n.startswith("kvstream_") or n in PROMETHEUS_SERIES}
        assert names, f"{title}: no metric in {target['expr']!r}"
        labels |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        allowed = set(TARGET_LABELS)
        for name in names - PROMETHEUS_SERIES:
            if name not in known:
                problems.append(f"{title}: {name} is not a metric of the code")
            else:
                allowed |= known[name].labels
        if names & PROMETHEUS_SERIES:
            allowed = TARGET_LABELS | {"__name__"}
        if labels - allowed:
            problems.append(f"{title}: labels {sorted(labels - allowed)} are not on {sorted(names)}")
        used |= names
    assert not problems, "\n".join(problems)
    assert REQUIRED_ON_DASHBOARD <= used, f"missing from the dashboard: {REQUIRED_ON_DASHBOARD - used}"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_prometheus_scrapes_every_kvstream_service():
    config = yaml.safe_load(PROMETHEUS.read_text())
    spec = compose()
    stages = dockerfile_stages()
    expected: dict[str, set[str]] = {}
    for name, svc in kvstream_services(spec).items():
        ctx = parse_kvstream(image_argv(stages[image_target(svc)], svc.get("command")))
        if ctx.command.name == "router":
            expected.setdefault("kvstream-router", set()).add(f"{name}:{stages['router'].env['KVSTREAM_REPLICA__PORT']}")
        elif ctx.command.name == "worker":
            assert ctx.params["metrics_port"], f"{name} serves no metrics (--metrics-port)"
            expected.setdefault("kvstream-worker", set()).add(f"{name}:{ctx.params['metrics_port']}")
    jobs = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in config["scrape_configs"]
    }
    assert jobs == expected
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"])
    # The dashboard's `up{job=~...}` selects these jobs.
    for _, target in dashboard_targets():
        for pattern in re.findall(r'job=~"([^"]*)"', target["expr"]):
            assert all(re.fullmatch(pattern, job) for job in jobs)


def test_prometheus_and_grafana_get_their_files():
    spec = compose()
    prometheus = spec["services"]["prometheus"]
    config_arg = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    mounts = dict(v.removesuffix(":ro").split(":") for v in prometheus["volumes"])
    assert (COMPOSE.parent / "../ops/prometheus/prometheus.yml").resolve() == PROMETHEUS
    assert mounts["../ops/prometheus/prometheus.yml"] == config_arg.split("=", 1)[1]

    grafana = spec["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":") for v in grafana["volumes"])
    assert (COMPOSE.parent / "../ops/grafana/provisioning").resolve() == GRAFANA_PROVISIONING
    assert mounts["../ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboard_in_container = Path(mounts["../ops/grafana/kvstream-dashboard.json"])
    providers = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "kvstream.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [str(dashboard_in_container.parent)]
    datasource = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())
    [source] = datasource["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090" and any(p.endswith("9090:9090") for p in prometheus["ports"])
