"""The gateway's HTTP server: uvicorn with h11, guarded so that no client can lock others out.

uvicorn times out idle keep-alive connections but not a request head or body that never ends, so one client
sending heads or bodies byte by byte (slowloris) held connections, and file descriptors, until the process
could accept no more. `GuardedH11Protocol` closes a connection whose request head has not arrived whole within
`header_timeout`, answers 408 and closes one whose body has not arrived within `body_timeout` of its head plus
a second for every BODY_MIN_RATE bytes received (a large upload on a slow link still finishes; a trickle does
not), and keeps at most `max_connections` open: a new connection past that takes the place of the one that has
waited longest for a head, or is answered 503 when every connection is busy.
"""
from __future__ import annotations

import json
import logging
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body
from .settings import GatewaySettings

log = logging.getLogger("redline.gateway")

FILE_MARGIN = 64  # descriptors beyond connections and Redis: the listening socket, logs, the interpreter's own
REFUSED = json.dumps(error_body(503, "the gateway has no free connection: every one is busy with a request; "
                                     "retry shortly")).encode()
BODY_MIN_RATE = 64 * 1024  # bytes a second a request body is given beyond body_timeout


def _closing_response(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


REFUSED_RESPONSE = _closing_response("503 Service Unavailable", REFUSED)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head and a cap on open connections.
    `guarded_protocol` makes the subclass that carries the settings and metrics."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1000
    metrics = None  # GatewayMetrics, or None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.head_timer = self.body_timer = None
        self.body_since, self.body_bytes = 0.0, 0
        self.idle_since = self.loop.time()
        self._arm_head_timer()
        if self.metrics is not None:
            self.metrics.open_connections.inc()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        if self.metrics is not None:
            self.metrics.open_connections.dec()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.head_timer is None and self.waiting_for_head():
            self._arm_head_timer()  # the first bytes of a request on a kept-alive connection
        if self.body_timer is not None:
            self.body_bytes += len(data)
        super().data_received(data)
        if not self.waiting_for_head():
            self._disarm_head_timer()
        if self.conn.their_state is h11.SEND_BODY:
            if self.body_timer is None:  # a head has arrived whole; its body is still to come
                self.body_since, self.body_bytes = self.loop.time(), 0
                self._arm_body_timer()
        else:
            self._disarm_body_timer()

    def on_response_complete(self) -> None:
        self.idle_since = self.loop.time()
        super().on_response_complete()

    def waiting_for_head(self) -> bool:
        """No request is being answered, and the next one's head has not arrived whole."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _arm_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        self.head_timer = _cancelled(self.head_timer)

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.waiting_for_head() and not self.transport.is_closing():
            self._drop("head_timeout")

    def _body_deadline(self) -> float:
        return self.body_since + self.body_timeout_s + self.body_bytes / BODY_MIN_RATE

    def _arm_body_timer(self) -> None:
        self.body_timer = self.loop.call_at(self._body_deadline(), self._body_timed_out)

    def _disarm_body_timer(self) -> None:
        self.body_timer = _cancelled(self.body_timer)

    def _body_timed_out(self) -> None:
        self.body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        if self.loop.time() < self._body_deadline():  # more came meanwhile: its deadline moved on
            self._arm_body_timer()
            return
        if self.cycle is None or not self.cycle.response_started:
            seconds = self.loop.time() - self.body_since
            self.transport.write(_closing_response("408 Request Timeout", json.dumps(error_body(
                408, f"the request body did not arrive in time: {self.body_bytes:,} bytes in {seconds:.0f} s "
                     f"(the gateway gives a body {self.body_timeout_s:g} s plus a second per "
                     f"{BODY_MIN_RATE // 1024} KiB)")).encode()))
        self._drop("body_timeout")

    def _make_room(self) -> None:
        """Close the connection that has waited longest for a request head, or refuse this one."""
        waiting = [c for c in self.connections
                   if c is not self and isinstance(c, GuardedH11Protocol) and c.waiting_for_head()
                   and not c.transport.is_closing()]
        if waiting:
            min(waiting, key=lambda c: c.idle_since)._drop("evicted")
        else:
            self.transport.write(REFUSED_RESPONSE)
            self._drop("refused")

    def _drop(self, reason: str) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        self.connections.discard(self)  # its place is free now, not when the close completes
        self.transport.close()
        if self.metrics is not None:
            self.metrics.connection_dropped(reason)


def _cancelled(timer) -> None:
    """Cancel an asyncio timer handle, if any; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()


def guarded_protocol(settings: GatewaySettings, metrics=None) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's `http=`, carrying the settings' bounds."""
    return type("GatewayProtocol", (GuardedH11Protocol,), {
        "head_timeout_s": settings.header_timeout, "body_timeout_s": settings.body_timeout,
        "max_connections": settings.max_connections, "metrics": metrics})


def raise_file_limit(needed: int) -> None:
    """Raise this process's open-file limit to `needed` where the hard limit allows (it is often 1024 while
    the hard limit is far higher); warn where it cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            log.warning("the open-file limit is %d (hard limit); --max-connections and the Redis connections need "
                        "%d: raise it (ulimit -n) or lower --max-connections", target, needed)
