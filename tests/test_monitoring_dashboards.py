"""Every Grafana panel query, evaluated by a real Prometheus that scraped a worker which processed jobs and a
gateway which answered requests.

The worker is a real `redline worker` process (tiny built-in model, dummy weights, CPU) serving an
embedded redis-server, fed jobs through `producer.Client`; the gateway a real `redline serve` process on
the same queue, called through the official `openai` client. Prometheus is Debian's `prometheus` package
(`.ci/run` installs it); without the binary these tests skip and say so. The test starts its own
Prometheus on a free port with a config derived from monitoring/prometheus.yml (same job name, 1 s
scrapes) and never touches a system service.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
DASHBOARDS = sorted((MONITORING / "grafana" / "dashboards").glob("*.json"))
WORKER_JOB = "redline-worker"
GATEWAY_JOB = "redline-gateway"
SCRAPE_SECONDS = 1
QUEUE = "dash_test"
NUM_JOBS = 6

PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the `prometheus` binary is not installed (Debian package `prometheus`; .ci/run installs it), "
           "so dashboard queries cannot be evaluated",
)


def panel_targets():
    """(dashboard file, panel title, refId, expr) for every query of every panel."""
    for path in DASHBOARDS:
        for panel in walk_panels(json.loads(path.read_text())["panels"]):
            for target in panel.get("targets", []):
                yield path.name, panel["title"], target["refId"], target["expr"]


def walk_panels(panels):
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))  # panels inside collapsed rows


TARGETS = list(panel_targets())


# -- processes ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get_json(url: str, params: dict | None = None) -> dict:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # Prometheus explains a bad query in the body of a 400
        return json.loads(e.read())


def wait_until(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prometheus_config(targets: dict[str, list[str]]) -> dict:
    """monitoring/prometheus.yml with the worker and gateway jobs pointed at local targets ({job: targets})
    and 1 s scrapes."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = f"{SCRAPE_SECONDS}s"
    config["global"]["evaluation_interval"] = f"{SCRAPE_SECONDS}s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(targets) <= set(jobs), f"monitoring/prometheus.yml lacks a job of {sorted(targets)}"
    config["scrape_configs"] = []
    for name, addresses in targets.items():
        job = {k: v for k, v in jobs[name].items() if not k.endswith("_sd_configs")}
        job["static_configs"] = [{"targets": addresses}]
        config["scrape_configs"].append(job)
    return config


class Prometheus:
    def __init__(self, tmp: Path, targets: dict[str, list[str]]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = tmp / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(prometheus_config(targets)))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self.ready, 60, "Prometheus to start", self.proc)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> dict:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return http_get_json(self.url + "/api/v1/query", params)

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        return http_get_json(self.url + "/api/v1/query_range",
                             {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def close(self):
        stop(self.proc)
        self.log.close()


def worker_env() -> dict:
    # Settings come from the flags alone: no REDLINE_* or REDIS_URL leaking in from the caller.
    return {k: v for k, v in os.environ.items() if not k.startswith("REDLINE_") and k != "REDIS_URL"}


def metrics_text(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return None


def use_the_gateway(port: int) -> None:
    """Requests of each kind a gateway answers that run no job: models, a 404, a file, a batch that fails."""
    import openai

    client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=30)
    client.models.list()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_none")
    f = client.files.create(file=("in.jsonl", b"not jsonl\n"), purpose="batch")
    assert client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h").status == "failed"


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A Prometheus that scraped a real `redline worker` and `redline serve` before, while and after they
    processed jobs and requests."""
    if PROMETHEUS is None:
        pytest.skip(needs_prometheus.kwargs["reason"])
    from engine.builtin import TINY_MODEL_DIR
    from producer import Client
    from producer.embedded import RedisServer

    tmp = tmp_path_factory.mktemp("prometheus")
    port, gateway_port = free_port(), free_port()
    redis_server = RedisServer().start()
    worker_log, gateway_log = open(tmp / "worker.log", "w"), open(tmp / "gateway.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "worker", "--model", TINY_MODEL_DIR, "--load-format", "dummy",
         "--device", "cpu", "--redis-url", redis_server.url, "--queue", QUEUE, "--metrics-port", str(port)],
        cwd=ROOT, env=worker_env(), stdout=worker_log, stderr=subprocess.STDOUT)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "serve", "--redis-url", redis_server.url, "--queue", QUEUE,
         "--port", str(gateway_port)], cwd=ROOT, env=worker_env(), stdout=gateway_log, stderr=subprocess.STDOUT)
    prometheus = None
    try:
        wait_until(lambda: metrics_text(port), 120, "the worker's /metrics", worker)
        wait_until(lambda: metrics_text(gateway_port), 60, "the gateway's /metrics", gateway)
        prometheus = Prometheus(tmp, {WORKER_JOB: [f"127.0.0.1:{port}"], GATEWAY_JOB: [f"127.0.0.1:{gateway_port}"]})
        # rate() needs samples from before the jobs; the queue gauges appear at the worker's first upkeep.
        wait_until(lambda: prometheus.scalar(f'up{{job="{WORKER_JOB}"}}') == 1, 60, "the first scrape")
        wait_until(lambda: prometheus.scalar(f'up{{job="{GATEWAY_JOB}"}}') == 1, 60, "the gateway's first scrape")
        wait_until(lambda: prometheus.scalar("count(redline_queue_stream_length)"), 60,
                   "the worker's first queue-depth report")
        start = time.time()
        with Client(redis_server.url, queue=QUEUE) as client:
            job_ids = [client.submit(prompt=f"job {i}: tell me about queues and caches",
                                     sampling={"max_tokens": 8, "ignore_eos": True}, priority=2 if i % 2 else 0)
                       for i in range(NUM_JOBS)]
            results = [client.result(job_id, timeout=120) for job_id in job_ids]
        assert [r.status for r in results] == ["succeeded"] * NUM_JOBS
        use_the_gateway(gateway_port)
        done = f'sum(redline_jobs_completed_total{{queue="{QUEUE}",status="succeeded"}})'
        wait_until(lambda: prometheus.scalar(done) == NUM_JOBS, 60, "Prometheus to see every job finished")
        time.sleep(3 * SCRAPE_SECONDS)  # a few more scrapes so every rate window closes over the jobs
        yield {"prometheus": prometheus, "start": start, "end": time.time(),
               "exposition": metrics_text(port) + metrics_text(gateway_port)}
    finally:
        if prometheus is not None:
            prometheus.close()
        stop(gateway)
        stop(worker)
        worker_log.close()
        gateway_log.close()
        redis_server.stop()


def grafana_variables(start: float, end: float) -> dict[str, str]:
    """Values Grafana would put in the queries for a dashboard showing [start, end] at 1 s resolution."""
    step = SCRAPE_SECONDS
    return {
        # Grafana: max(4 x scrape interval, step + scrape interval), the datasource's timeInterval
        "__rate_interval": f"{max(4 * SCRAPE_SECONDS, step + SCRAPE_SECONDS)}s",
        "__interval": f"{step}s",
        "__range": f"{math.ceil(end - start)}s",
        "queue": QUEUE,  # what Grafana sends for one selected value
    }


def substitute(expr: str, variables: dict[str, str]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in variables, f"unknown Grafana variable ${name} in {expr!r}"
        return variables[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


def test_dashboards_exist_with_queries():
    assert DASHBOARDS, "no dashboards under monitoring/grafana/dashboards"
    assert len(TARGETS) >= 20


@needs_prometheus
@pytest.mark.parametrize("dashboard,panel,ref,expr", TARGETS,
                         ids=[f"{d}:{p}:{r}" for d, p, r, _ in TARGETS])
def test_panel_query_returns_data(scraped, dashboard, panel, ref, expr):
    prometheus, start, end = scraped["prometheus"], scraped["start"], scraped["end"]
    query = substitute(expr, grafana_variables(start, end))
    reply = prometheus.query_range(query, start - 2 * SCRAPE_SECONDS, end, SCRAPE_SECONDS)
    assert reply["status"] == "success", f"{query!r}: {reply.get('error')}"
    series = reply["data"]["result"]
    assert series, f"{dashboard} / {panel} / {ref}: no series for {query!r}"
    values = [float(v) for s in series for _, v in s["values"]]
    assert any(math.isfinite(v) for v in values), f"{query!r} returned only NaN/Inf"


@needs_prometheus
def test_panels_refer_only_to_metrics_the_worker_and_gateway_export(scraped):
    exported = set(re.findall(r"^(redline_\w+?)(?:\{| )", scraped["exposition"], re.MULTILINE))
    referenced = {name for _, _, _, expr in TARGETS for name in re.findall(r"\bredline_\w+", expr)}
    assert referenced, "no redline_ metric in any panel"
    assert referenced <= exported, f"not exported by the worker or gateway: {sorted(referenced - exported)}"


@needs_prometheus
def test_queue_variable_lists_the_workers_queue(scraped):
    prometheus = scraped["prometheus"]
    for path in DASHBOARDS:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
            assert match, f"{path.name}: variable {variable['name']} has an unexpected query {query!r}"
            metric, label = match.groups()
            reply = http_get_json(f"{prometheus.url}/api/v1/label/{label}/values", {"match[]": metric})
            assert QUEUE in reply["data"], f"{path.name}: {query} → {reply['data']}"


# -- static checks: what Grafana needs to load the files as provisioned ------------------------------

def provisioned_datasource_uid() -> str:
    provisioning = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (datasource,) = provisioning["datasources"]
    assert datasource["type"] == "prometheus"
    return datasource["uid"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_dashboard_names_the_provisioned_datasource_by_uid(path):
    text = path.read_text()
    assert "${DS_" not in text and "__inputs" not in text, "an export placeholder Grafana cannot provision"
    uid = provisioned_datasource_uid()
    dashboard = json.loads(text)
    for panel in walk_panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"]["uid"] == uid


def test_dashboards_have_unique_uids_and_panel_ids():
    uids = [json.loads(p.read_text())["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids)
    for path in DASHBOARDS:
        ids = [panel["id"] for panel in walk_panels(json.loads(path.read_text())["panels"])]
        assert len(set(ids)) == len(ids), path.name


def test_every_panel_has_a_query_and_stays_on_the_grid():
    for path in DASHBOARDS:
        for panel in walk_panels(json.loads(path.read_text())["panels"]):
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, f"{path.name}: {panel['title']}"
            if panel["type"] != "row":
                assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_every_exported_metric_has_a_panel():
    from monitoring.gateway_metrics import GatewayMetrics
    from monitoring.metrics import Metrics

    families = {family.name for metrics in (Metrics(), GatewayMetrics()) for family in metrics.registry.collect()}
    shown = " ".join(expr for _, _, _, expr in TARGETS)
    missing = sorted(name for name in families
                     if not re.search(rf"\b{name}(_total|_bucket|_sum|_count)?\b", shown))
    assert not missing, f"metrics no panel shows: {missing}"
