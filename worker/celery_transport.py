"""kombu's Redis transport, as a worker reads a Celery queue with it: no message can stop or bloat the worker.

kombu reads a message's JSON envelope, builds its `Message` (body decoded, then decompressed without a bound)
and files it as unacked before any consumer sees it; a message it cannot read raises out of `drain_events`.
Here a message that is not kombu's envelope raises `BadMessage` instead, already off the queue and never in the
unacked set, for the source to drop (or to fail its task, when its headers name one). A body may be at most
the worker's `max_job_bytes`, a compressed one decompressed incrementally up to that bound: past it, or in a
compression that cannot be bounded, the message carries the error as kombu's own decode errors do, and its
consumer's `on_decode_error` fails its task.
"""
from __future__ import annotations

import bz2
import lzma
import zlib
from queue import Empty

from kombu import compression
from kombu.transport import redis, virtual

MAX_BODY_BYTES_OPTION = "max_body_bytes"  # the transport option that carries the worker's max_job_bytes
LZMA_MEMORY_LIMIT = 128 * 2**20  # xz -9 needs 65 MiB to decompress; a larger dictionary is a bomb's

# kombu's decoder for each compression it registers → a fresh incremental decompressor of the same format
_INCREMENTAL = {
    zlib.decompress: zlib.decompressobj,
    bz2.decompress: bz2.BZ2Decompressor,
    lzma.decompress: lambda: lzma.LZMADecompressor(memlimit=LZMA_MEMORY_LIMIT),
}
try:  # kombu registers zstd where this module is installed; it bounds its output the same way
    from compression import zstd  # type: ignore[import-not-found]  # Python 3.14
except ImportError:
    try:
        from backports import zstd  # type: ignore[import-not-found]
    except ImportError:
        zstd = None
if zstd is not None:
    _INCREMENTAL[zstd.decompress] = zstd.ZstdDecompressor
# named to a producer whose compression is refused
BOUNDED_COMPRESSIONS = "zlib, bzip2, lzma" + (", zstd" if zstd is not None else "")


class BadMessage(Exception):
    """A message that is not kombu's envelope; taken off the queue already, never filed as unacked."""

    def __init__(self, error: str, task_id: str | None = None, channel=None) -> None:
        super().__init__(error)
        self.error, self.task_id, self.channel = error, task_id, channel


def decompress(body: bytes, name, limit: int) -> bytes:
    """`body` decompressed as kombu's `compression` header `name` says, never past `limit` bytes;
    ValueError saying why for one that is larger, broken, or in a compression that cannot be bounded."""
    try:
        decoder = compression.get_decoder(name)
    except (KeyError, TypeError):
        raise ValueError(f"unknown compression {name!r}: send with {BOUNDED_COMPRESSIONS} or none") from None
    incremental = _INCREMENTAL.get(decoder)
    if incremental is None:
        raise ValueError(f"compression {name!r} cannot be bounded by a redline worker: send with "
                         f"{BOUNDED_COMPRESSIONS} or none")
    if not isinstance(body, bytes):
        raise ValueError(f"the {name} body is not bytes")
    decompressor = incremental()
    try:
        data = decompressor.decompress(body, limit + 1)
    except Exception as e:  # each format has its own error for bytes it cannot decompress (zlib.error, ...)
        raise ValueError(f"the {name} body is corrupt ({type(e).__name__}: {e})") from None
    if len(data) > limit:
        raise ValueError(f"the body decompresses to more than {limit:,} bytes; this worker takes at most "
                         f"{limit:,} (max_job_bytes)")
    if not decompressor.eof or decompressor.unused_data:
        raise ValueError(f"the {name} body is truncated or has data after its end")
    return data


def _envelope_error(payload, channel) -> str | None:
    """What keeps kombu from filing `payload` as a message, or None."""
    if not isinstance(payload, dict):
        return f"the message is a JSON {type(payload).__name__}, not kombu's envelope (an object)"
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        return "the message has no properties object"
    if not isinstance(properties.get("delivery_tag"), str) or not properties["delivery_tag"]:
        return "the message's properties have no delivery_tag"
    info = properties.get("delivery_info")
    if not isinstance(info, dict) or "exchange" not in info or "routing_key" not in info:
        return "the message's delivery_info is not an object naming its exchange and routing_key"
    if not isinstance(payload.get("headers") or {}, dict):
        return "the message's headers are not an object"
    encoding = properties.get("body_encoding")
    if encoding and encoding not in channel.codecs:
        return f"the message's body_encoding {encoding!r} is not one kombu reads ({', '.join(channel.codecs)})"
    return None


def _task_id(payload) -> str | None:
    headers = payload.get("headers") if isinstance(payload, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id if isinstance(task_id, str) and task_id else None


class CheckedMessage(virtual.Message):
    """kombu's message, built only from a well-formed envelope; its body (decompressed) within the channel's bound."""

    def __init__(self, payload, channel=None, **kwargs) -> None:
        error = _envelope_error(payload, channel)
        if error:
            raise BadMessage(error, _task_id(payload), channel)
        headers = payload.get("headers") or {}
        packed = headers.get("compression")
        try:  # kombu decodes the body; the decompression is left to the bounded step below
            super().__init__({**payload, "headers": {k: v for k, v in headers.items() if k != "compression"}},
                             channel=channel, **kwargs)
        except Exception as e:
            raise BadMessage(f"kombu could not read it: {type(e).__name__}: {e}", _task_id(payload),
                             channel) from None
        self._raw, self.headers = payload, headers  # filed as unacked (and restored) as it came
        if self.errors:
            return
        limit = channel.max_body_bytes
        try:
            if packed:
                self.body = decompress(self.body, packed, limit)
            elif isinstance(self.body, bytes) and len(self.body) > limit:  # refused before it is parsed
                raise ValueError(f"the body is {len(self.body):,} bytes; this worker takes at most {limit:,} "
                                 "(max_job_bytes)")
        except ValueError as e:  # as kombu records a failed decompression: on to on_decode_error
            self.errors.append((type(e), e, None))


class Channel(redis.Channel):
    """kombu's Redis channel with checked messages."""

    Message = CheckedMessage
    max_body_bytes = 4 * 2**20  # set from the `max_body_bytes` transport option
    from_transport_options = redis.Channel.from_transport_options + (MAX_BODY_BYTES_OPTION,)

    def _brpop_read(self, **options):
        """kombu's read of one message off a queue; one that is not JSON raises `BadMessage`."""
        self.connection.handed_over = False
        try:
            return super()._brpop_read(**options)
        except (BadMessage, Empty, *self.connection_errors):
            raise
        except Exception as e:
            if self.connection.handed_over:  # the message was read; this came from a consumer of it
                raise
            raise BadMessage(f"the message is not JSON kombu reads ({type(e).__name__}: {e})",
                             channel=self) from None


class Transport(redis.Transport):
    """kombu's Redis transport with `Channel`s of checked messages."""

    Channel = Channel

    def _deliver(self, message, queue):
        self.handed_over = True  # read from Redis as JSON: what fails from here is not kombu's reading
        return super()._deliver(message, queue)
