"""docker-compose.yml: valid for compose, and shaped as docs/deploy.md says
(only the gateway's APIs, the block map and the observability profile's UIs
published, on loopback; health-gated start order; the gpu profile reserves an
NVIDIA device; every service's metrics reachable on the internal network and
scraped by the profile's Prometheus). Needs a compose binary, not an engine."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ONE_SHOT = {"model-init"}  # runs to completion; no healthcheck, depended on by completion
NOT_GRPC = {"redis", "prometheus", "grafana"}  # health-checked their own way
KVPAGER = ("memory", "executor", "executor-cpu", "gateway")


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


COMPOSE = compose_command()
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="no docker-compose / docker compose binary")


def compose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COMPOSE, "-f", str(COMPOSE_FILE), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def yaml_to_json(text: str) -> dict:
    """PyYAML when importable; else the interpreter docker-compose v1 runs on,
    which always has it."""
    try:
        import yaml

        return yaml.safe_load(text)
    except ImportError:
        pass
    with open(shutil.which("docker-compose"), "rb") as f:
        shebang = f.readline().decode().removeprefix("#!").split()
    if not shebang:
        pytest.skip("no YAML parser: PyYAML absent and docker-compose is not a Python script")
    out = subprocess.run([*shebang, "-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"],
                         input=text, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    """The resolved config, every profile's services included."""
    args = ("--profile", "gpu", "--profile", "cpu", "--profile", "observability", "config")
    as_json = compose(*args, "--format", "json")  # compose v2; v1 prints its usage instead
    if as_json.returncode == 0:
        try:
            return json.loads(as_json.stdout)
        except json.JSONDecodeError:
            pass
    out = compose(*args)
    assert out.returncode == 0, out.stderr
    return yaml_to_json(out.stdout)


def published(service: dict) -> list[tuple[str, str]]:
    """(host ip, published port) per port, short ("ip:pub:target") or long form."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((port.get("host_ip", ""), str(port.get("published", ""))))
        else:
            parts = str(port).split(":")
            out.append((parts[0] if len(parts) == 3 else "", parts[-2] if len(parts) > 1 else ""))
    return out


def test_config_is_valid():
    out = compose("config", "-q")
    assert out.returncode == 0, out.stderr


def test_services_and_profiles(config):
    services = config["services"]
    assert set(services) == {"redis", "model-init", "memory", "executor", "executor-cpu", "gateway", "prometheus",
                             "grafana"}
    assert services["executor"]["profiles"] == ["gpu"] and services["executor-cpu"]["profiles"] == ["cpu"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["observability"]
    assert "--redis-url=redis://redis:6379/0" in services["memory"]["command"]


def test_only_the_front_doors_are_published_on_loopback(config):
    services = config["services"]
    assert "ports" not in services["redis"]
    assert {name for name, s in services.items() if s.get("ports")} == {"gateway", "memory", "prometheus", "grafana"}
    assert published(services["gateway"]) == [("127.0.0.1", "50050"), ("127.0.0.1", "8000")]
    assert published(services["memory"]) == [("127.0.0.1", "8001")]  # the read-only block map
    assert published(services["prometheus"]) == [("127.0.0.1", "9090")]
    assert published(services["grafana"]) == [("127.0.0.1", "3000")]
    assert "--http-port=8000" in services["gateway"]["command"]
    assert "--http-port=8001" in services["memory"]["command"]


def test_backend_network_is_internal(config):
    assert config["networks"]["backend"].get("internal") is True
    assert not config["networks"]["front"].get("internal")
    services = config["services"]
    for name in ("gateway", "memory", "prometheus", "grafana"):
        assert set(services[name]["networks"]) == {"backend", "front"}, name
    for name in ("redis", "executor", "executor-cpu"):
        assert set(services[name]["networks"]) == {"backend"}, name


def test_every_backend_service_is_health_checked(config):
    for name, service in config["services"].items():
        if name in ONE_SHOT:
            continue
        check = service.get("healthcheck")
        assert check and check["test"] and not check.get("disable"), name
        if name not in NOT_GRPC:  # gRPC services: grpc.health.v1 against their own port
            assert "grpc_health" in " ".join(check["test"]), name
            port = next(arg.split("=")[1] for arg in service["command"] if arg.startswith("--port="))
            assert service["environment"]["KVPAGER_HEALTH_ADDRESS"] == f"127.0.0.1:{port}", name


def test_depends_on_waits_for_health(config):
    services = config["services"]
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for dep, spec in depends.items():
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert spec["condition"] == want, (name, dep)
    assert set(services["memory"]["depends_on"]) == {"redis"}
    assert set(services["executor"]["depends_on"]) == {"memory", "model-init"}
    assert set(services["gateway"]["depends_on"]) >= {"memory"}


def test_gpu_profile_reserves_an_nvidia_device(config):
    devices = config["services"]["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "--device=cuda" in config["services"]["executor"]["command"]
    assert "deploy" not in config["services"]["executor-cpu"]


def test_models_volume_and_model_init(config):
    assert "models" in config["volumes"]
    init = config["services"]["model-init"]
    assert "kvpager demo-model /models/demo" in " ".join(init["command"])
    for name in ("model-init", "executor", "executor-cpu", "gateway"):
        mounts = config["services"][name]["volumes"]
        targets = [m["target"] if isinstance(m, dict) else m.split(":")[1] for m in mounts]
        assert "/models" in targets, name


# --- the observability profile ------------------------------------------------------------

PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "docs" / "grafana" / "kvpager.json"


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) per volume, short or long form."""
    out = []
    for m in service.get("volumes", []):
        if isinstance(m, dict):
            out.append((str(m.get("source", "")), m["target"]))
        else:
            parts = m.split(":")
            out.append((parts[0], parts[1]))
    return out


def flag(service: dict, name: str) -> str | None:
    return next((arg.split("=", 1)[1] for arg in service["command"] if arg.startswith(f"--{name}=")), None)


def test_prometheus_config_passes_promtool():
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian's prometheus package; scripts/install.sh --test installs it) is missing")
    out = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_scrapes_every_service_on_its_metrics_port(config):
    scrape = yaml_to_json(PROMETHEUS_CONFIG.read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    services = config["services"]
    for name in KVPAGER:
        s = services[name]
        assert flag(s, "metrics-host") == "0.0.0.0", name  # reachable from Prometheus' container
        assert f"{name}:{flag(s, 'metrics-port')}" in targets, name
    assert {t.split(":")[0] for t in targets} == set(KVPAGER)
    assert any(src.endswith("docker/prometheus/prometheus.yml") and dst == "/etc/prometheus/prometheus.yml"
               for src, dst in mounts(services["prometheus"]))


def metric_names(expr: str) -> set[str]:
    import re

    return set(re.findall(r"\bkvpager_[a-z0-9_]+", expr))


def documented_families() -> set[str]:
    """Every full kvpager_* name in docs/metrics.md's tables (counters as exposed, with _total)."""
    import re

    text = (ROOT / "docs" / "metrics.md").read_text()
    return {n for n in re.findall(r"`(kvpager_[a-z0-9_]+)", text) if not n.endswith("_")}


def test_the_dashboard_has_the_panels_and_charts_only_documented_metrics(config):
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for want in ("throughput", "time to first token", "inter-token", "running / waiting", "kv cache usage",
                 "prefix cache hit rate", "preemptions", "sharing saved"):
        assert want in titles, want
    documented = documented_families()
    datasource = yaml_to_json((ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == uid and panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in metric_names(target["expr"]):
                base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                assert base in documented, (panel["title"], name)
            if "histogram_quantile" in target["expr"]:
                assert "_bucket" in target["expr"]
    provider = yaml_to_json((ROOT / "docker/grafana/provisioning/dashboards/kvpager.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert any(src.endswith("docs/grafana") and dst == "/var/lib/grafana/dashboards"
               for src, dst in mounts(config["services"]["grafana"]))
