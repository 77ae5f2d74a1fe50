"""Every Grafana panel query, evaluated by a real Prometheus that scraped a worker which processed jobs.

Prometheus is Debian's `prometheus` package (`.ci/run` installs it); without the binary these tests skip
and say so. The test starts its own Prometheus on a free port with a config derived from
monitoring/prometheus.yml (same job name, 1 s scrapes) and never touches a system service.
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


def prometheus_config(worker_targets: list[str]) -> dict:
    """monitoring/prometheus.yml with the worker job pointed at local targets and 1 s scrapes."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = f"{SCRAPE_SECONDS}s"
    config["global"]["evaluation_interval"] = f"{SCRAPE_SECONDS}s"
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == WORKER_JOB]
    assert jobs, f"monitoring/prometheus.yml has no {WORKER_JOB!r} job"
    job = {k: v for k, v in jobs[0].items() if not k.endswith("_sd_configs")}
    job["static_configs"] = [{"targets": worker_targets}]
    config["scrape_configs"] = [job]
    return config


class Prometheus:
    def __init__(self, tmp: Path, worker_targets: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = tmp / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(prometheus_config(worker_targets)))
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


# The worker that Prometheus scrapes. It uses the real Metrics object over HTTP and feeds it the
# sequence of hooks a worker makes while draining jobs.
STANDIN_WORKER = r"""
import sys, time
from types import SimpleNamespace as NS
from monitoring.metrics import Metrics, start_metrics_server
port, queue, num_jobs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
m = Metrics(queue=queue, model="tiny")
start_metrics_server(port, m)
m.heartbeat(); m.set_queue_depth("0", 0); m.set_pending(0)
print("ready", flush=True)
sys.stdin.readline()
m.set_queue_depth("0", num_jobs); m.job_received(num_jobs); m.set_pending(num_jobs)
for i in range(num_jobs):
    m.observe_queue_time(0.05 * (i + 1))
    t0 = time.monotonic()
    m.observe_step(NS(num_prefill_tokens=40, num_decode_tokens=0, num_running=1, num_waiting=num_jobs - i - 1,
                      kv_cache_usage=0.3, num_preemptions=0, prefix_cache_queries=40, prefix_cache_hits=16,
                      step_seconds=0.02, batch_size=1))
    for _ in range(7):
        time.sleep(0.01)
        m.observe_step(NS(num_prefill_tokens=0, num_decode_tokens=1, num_running=1, num_waiting=0,
                          kv_cache_usage=0.3, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                          step_seconds=0.01, batch_size=1))
    m.observe_finished(NS(request_id=str(i), prompt_token_ids=list(range(40)), token_ids=list(range(8)),
                          finish_reason="length", num_cached_tokens=16, arrival_time=t0,
                          first_scheduled_time=t0, first_token_time=t0 + 0.02, finished_time=time.monotonic()))
    m.job_completed("succeeded")
    m.set_pending(num_jobs - i - 1); m.set_queue_depth("0", num_jobs - i - 1)
    m.heartbeat()
print("done", flush=True)
while True:
    time.sleep(0.5); m.heartbeat()
"""


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A Prometheus that has scraped a worker before, during and after it processed NUM_JOBS jobs."""
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-c", STANDIN_WORKER, str(port), QUEUE, str(NUM_JOBS)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    prometheus = None
    try:
        assert worker.stdout.readline().strip() == "ready"
        prometheus = Prometheus(tmp, [f"127.0.0.1:{port}"])
        # rate() needs a sample from before the jobs: wait for the first successful scrape.
        wait_until(lambda: prometheus.scalar(f'up{{job="{WORKER_JOB}"}}') == 1, 60, "the first scrape")
        start = time.time()
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "done"
        done = f'sum(redline_jobs_completed_total{{queue="{QUEUE}",status="succeeded"}})'
        wait_until(lambda: prometheus.scalar(done) == NUM_JOBS, 60, "Prometheus to see every job finished")
        time.sleep(3 * SCRAPE_SECONDS)  # a few more scrapes so every rate window closes over the jobs
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            exposition = resp.read().decode()
        yield {"prometheus": prometheus, "start": start, "end": time.time(), "exposition": exposition}
    finally:
        if prometheus is not None:
            prometheus.close()
        stop(worker)


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
def test_panels_refer_only_to_metrics_the_worker_exports(scraped):
    exported = set(re.findall(r"^(redline_\w+?)(?:\{| )", scraped["exposition"], re.MULTILINE))
    referenced = {name for _, _, _, expr in TARGETS for name in re.findall(r"\bredline_\w+", expr)}
    assert referenced, "no redline_ metric in any panel"
    assert referenced <= exported, f"not exported by the worker: {sorted(referenced - exported)}"


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
    from monitoring.metrics import Metrics

    families = {family.name for family in Metrics().registry.collect()}
    shown = " ".join(expr for _, _, _, expr in TARGETS)
    missing = sorted(name for name in families if not re.search(rf"\b{name}(_total|_bucket|_sum|_count)?\b", shown))
    assert not missing, f"metrics no panel shows: {missing}"
