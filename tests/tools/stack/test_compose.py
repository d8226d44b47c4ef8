"""docker-compose.yml and its overrides (docker-compose.secrets.yml,
docker-compose.tls.yml): every profile renders with `docker-compose config`,
and the result is shaped as docs/deploy.md says: no profile is a working CPU
stack; the gpu profile builds its own CUDA image and reserves an NVIDIA
device; models in a named volume or a bind mount; the admin token generated
once and read from a file (or Docker secrets); TLS-aware health checks; only
the gateway's APIs, the block map and the observability UIs published, on
loopback; health-gated start order; every service's metrics scraped by the
profile's Prometheus. Needs a compose binary, not an engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SECRETS_FILE = ROOT / "docker-compose.secrets.yml"
TLS_FILE = ROOT / "docker-compose.tls.yml"
ONE_SHOT = {"init"}  # runs to completion; no healthcheck, depended on by completion
NOT_GRPC = {"redis", "prometheus", "grafana"}  # health-checked their own way
KVPAGER = ("memory", "executor", "executor-cpu", "gateway")
DEFAULT = {"redis", "init", "memory", "executor-cpu", "gateway"}  # `docker compose up`, no profile


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


COMPOSE = compose_command()
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="no docker-compose / docker compose binary")


def compose(*args: str, files: tuple[Path, ...] = (COMPOSE_FILE,), env: dict | None = None):
    import os

    flags = [arg for f in files for arg in ("-f", str(f))]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_")}  # the file's defaults
    return subprocess.run([*COMPOSE, *flags, *args], check=False, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**environ, **(env or {})})


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


def rendered(*files: Path, env: dict | None = None) -> dict:
    """The resolved config of ``files`` (default: docker-compose.yml alone), every profile's services included."""
    files = files or (COMPOSE_FILE,)
    args = ("--profile", "gpu", "--profile", "observability", "config")
    as_json = compose(*args, "--format", "json", files=files, env=env)  # compose v2; v1 prints its usage
    if as_json.returncode == 0:
        try:
            return json.loads(as_json.stdout)
        except json.JSONDecodeError:
            pass
    out = compose(*args, files=files, env=env)
    assert out.returncode == 0, out.stderr
    return yaml_to_json(out.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    return rendered()


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


@pytest.mark.parametrize("files", [(COMPOSE_FILE,), (COMPOSE_FILE, SECRETS_FILE), (COMPOSE_FILE, TLS_FILE),
                                   (COMPOSE_FILE, SECRETS_FILE, TLS_FILE)], ids=["base", "secrets", "tls", "both"])
@pytest.mark.parametrize("profile", ["", "gpu", "observability"])
def test_every_profile_and_override_renders(files, profile):
    out = compose(*(("--profile", profile) if profile else ()), "config", "-q", files=files)
    assert out.returncode == 0, out.stderr


def test_no_profile_is_a_working_cpu_stack(config):
    services = config["services"]
    assert {name for name, s in services.items() if not s.get("profiles")} == DEFAULT
    assert services["executor"]["profiles"] == ["gpu"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["observability"]
    assert "--redis-url=redis://redis:6379/0" in services["memory"]["command"]
    cpu = services["executor-cpu"]["command"]
    assert "--device=cpu" in cpu and "--model=/models/demo" in cpu and "--memory-address=memory:50051" in cpu
    gateway = services["gateway"]["command"]
    assert "--model=/models/demo" in gateway and "--port=50050" in gateway and "--http-port=8000" in gateway
    # the CPU image: the CPU torch wheel, selected by the build argument
    assert services["executor-cpu"]["build"]["args"]["TORCH_VARIANT"] == "cpu"
    assert services["executor-cpu"]["image"] == services["gateway"]["image"] == "kvpager:latest"


def test_gpu_profile_builds_a_cuda_image_by_itself(config):
    executor = config["services"]["executor"]
    assert executor["image"] == "kvpager:cuda" != config["services"]["executor-cpu"]["image"]
    assert executor["build"]["args"]["TORCH_VARIANT"] == "cu128"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "ARG TORCH_VARIANT=cpu" in dockerfile
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}" in dockerfile
    assert 'pip install --index-url "${TORCH_INDEX_URL}"' in dockerfile


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
        if name not in NOT_GRPC:  # gRPC services: grpc.health.v1 against their own port, TLS-aware
            assert check["test"] == ["CMD", "python", "-m", "kvpager_tools.health"], name
            port = next(arg.split("=")[1] for arg in service["command"] if arg.startswith("--port="))
            assert service["environment"]["KVPAGER_HEALTH_ADDRESS"] == f"127.0.0.1:{port}", name
            assert service["environment"]["KVPAGER_HEALTH_SERVER_NAME"] == name, name  # its certificate's name


def test_depends_on_waits_for_health(config):
    services = config["services"]
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for dep, spec in depends.items():
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert spec["condition"] == want, (name, dep)
    assert set(services["memory"]["depends_on"]) == {"redis", "init"}
    assert set(services["executor"]["depends_on"]) == {"memory", "init"}
    assert set(services["gateway"]["depends_on"]) >= {"memory"}


def test_gpu_profile_reserves_an_nvidia_device(config):
    devices = config["services"]["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "--device=cuda" in config["services"]["executor"]["command"]
    assert "deploy" not in config["services"]["executor-cpu"]


def _mount(service: dict, target: str) -> tuple[str, str, bool] | None:
    """(type, source, read_only) of the mount at ``target``, short or long form."""
    for m in service.get("volumes", []):
        if isinstance(m, dict):
            if m["target"] == target:
                return m["type"], str(m.get("source", "")), bool(m.get("read_only"))
        else:
            parts = m.split(":")
            if parts[1] == target:
                kind = "bind" if parts[0].startswith(("/", ".")) else "volume"
                return kind, parts[0], len(parts) > 2 and "ro" in parts[2].split(",")
    return None


def test_models_volume_or_bind_mount(config):
    assert "models" in config["volumes"]
    init = config["services"]["init"]
    assert "kvpager demo-model /models/demo.tmp" in " ".join(init["command"])
    assert _mount(init, "/models") == ("volume", "models", False)  # init writes the demo model
    for name in ("executor", "executor-cpu", "gateway"):
        assert _mount(config["services"][name], "/models") == ("volume", "models", True), name
    # the documented way to serve your own checkpoints: a host directory, bind-mounted read-only
    own = rendered(env={"KVPAGER_MODELS_DIR": "./my-models", "KVPAGER_MODEL": "/models/mine"})
    for name in ("executor-cpu", "gateway"):
        kind, source, read_only = _mount(own["services"][name], "/models")
        assert kind == "bind" and source.endswith("/my-models") and read_only, name
        assert "--model=/models/mine" in own["services"][name]["command"], name
    assert own["services"]["init"]["environment"]["KVPAGER_MODEL"] == "/models/mine"


def test_the_admin_token_is_generated_once_and_read_from_a_file(config):
    services = config["services"]
    assert "kvpager-secrets" in config["volumes"]
    script = " ".join(services["init"]["command"])
    assert "umask 077" in script and "token_urlsafe" in script and "[ ! -s /run/kvpager-secrets/admin_token ]" in script
    assert _mount(services["init"], "/run/kvpager-secrets") == ("volume", "kvpager-secrets", False)
    for name in KVPAGER:
        s = services[name]
        assert s["environment"]["KVPAGER_ADMIN_TOKEN_FILE"] == "/run/kvpager-secrets/admin_token", name
        assert _mount(s, "/run/kvpager-secrets") == ("volume", "kvpager-secrets", True), name
        assert not any("token" in arg for arg in s["command"]), name  # never on a command line
    # read-only accounting open to the internal network, mutating RPCs behind the token
    assert "--open-read-only" in services["memory"]["command"]


def _secret_names(service: dict) -> set[str]:
    return {s["source"] if isinstance(s, dict) else s for s in service.get("secrets", [])}


def test_docker_secrets_override(config):
    own = rendered(COMPOSE_FILE, SECRETS_FILE)
    assert set(own["secrets"]) == {"admin_token", "auth_token"}
    assert own["secrets"]["admin_token"]["file"].endswith("/secrets/admin_token")
    for name in KVPAGER:
        s = own["services"][name]
        assert "admin_token" in _secret_names(s), name
        assert s["environment"]["KVPAGER_ADMIN_TOKEN_FILE"] == "/run/secrets/admin_token", name
    gateway = own["services"]["gateway"]
    assert gateway["environment"]["KVPAGER_AUTH_TOKEN_FILE"] == "/run/secrets/auth_token"
    assert _secret_names(gateway) == {"admin_token", "auth_token"}


def test_tls_override_keeps_the_health_checks_working(config):
    tls = rendered(COMPOSE_FILE, TLS_FILE)
    assert set(tls["secrets"]) == {"tls_cert", "tls_key", "tls_ca"}
    for name in KVPAGER:
        s = tls["services"][name]
        env = s["environment"]
        assert _secret_names(s) == {"tls_cert", "tls_key", "tls_ca"}, name
        assert env["KVPAGER_TLS_CERT"] == "/run/secrets/tls_cert" and env["KVPAGER_TLS_CA"] == "/run/secrets/tls_ca"
        assert str(env["KVPAGER_TLS_REQUIRE_CLIENT_AUTH"]) == "1"
        assert env["KVPAGER_TLS_CLIENT_CERT"] and env["KVPAGER_TLS_CLIENT_KEY"], name  # the health check's mTLS
        assert s["healthcheck"]["test"] == ["CMD", "python", "-m", "kvpager_tools.health"], name


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
                 "prefix cache hit rate", "preemptions", "sharing saved", "resident memory", "cpu by service"):
        assert want in titles, want
    documented = documented_families()
    docs = (ROOT / "docs" / "metrics.md").read_text()
    datasource = yaml_to_json((ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == uid and panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\bprocess_[a-z_]+", target["expr"]):
                assert f"`{name.removesuffix('_total')}" in docs, (panel["title"], name)
            for name in metric_names(target["expr"]):
                base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                assert base in documented, (panel["title"], name)
            if "histogram_quantile" in target["expr"]:
                assert "_bucket" in target["expr"]
    provider = yaml_to_json((ROOT / "docker/grafana/provisioning/dashboards/kvpager.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert any(src.endswith("docs/grafana") and dst == "/var/lib/grafana/dashboards"
               for src, dst in mounts(config["services"]["grafana"]))
