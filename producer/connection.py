"""Redis clients from URLs: one function (`connect`) builds the client for every caller.

`redis://`, `rediss://` and `unix://` name one server. `redis+cluster://` and `rediss+cluster://` name a
Redis Cluster by one or more of its nodes, comma-separated (`redis+cluster://:PASSWORD@10.0.0.1:6379,
10.0.0.2:6379`); the client finds the others and follows the cluster through MOVED replies and failovers.
A cluster has database 0 only. Every key of a queue shares its hash tag (`producer.protocol.Keys`), so a
queue lives on one node and its scripts run there whole.
"""
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterDownError, RedisClusterException, SlotNotCoveredError, TryAgainError

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DEFAULT_PORT = 6379

# Errors after which a call is retried as after a lost connection: the server is gone, or a cluster is
# failing over or moving the slot (MOVED/ASK reach only a connection tied to one node).
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError, SlotNotCoveredError,
               AskError)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def connect(url: str, *, asyncio: bool = False, pool_size: int | None = None, **options):
    """A client of the Redis (or, for redis+cluster://, the Redis Cluster) at `url`; `options` go to
    redis-py (socket_timeout, password, ...), the URL's own values winning. asyncio=True: the asyncio client.
    pool_size: at most this many connections (to each node), a caller past them waiting for one rather than
    failing as redis-py's default pool (100 connections) does: for servers whose requests each hold one while
    they wait on a blocking read."""
    if not is_cluster_url(url):
        cls = redis.asyncio.Redis if asyncio else redis.Redis
        if pool_size is None:
            return cls.from_url(url, **options)
        pool = (redis.asyncio.BlockingConnectionPool if asyncio else redis.BlockingConnectionPool).from_url(
            url, max_connections=pool_size, timeout=None, **options)
        return cls.from_pool(pool)
    seed, others = _cluster_seeds(url)
    cls, node = (AsyncRedisCluster, AsyncClusterNode) if asyncio else (RedisCluster, ClusterNode)
    if pool_size is not None:
        options["max_connections"] = pool_size
    return cls.from_url(seed, startup_nodes=[node(host, port) for host, port in others], **options)


def _cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """(URL of the first node for redis-py, the other nodes as (host, port))."""
    scheme, rest = url.split("://", 1)
    netloc, sep, tail = re.match(r"([^/?#]*)([/?#]?)(.*)", rest, re.S).groups()
    userinfo, at, hosts = netloc.rpartition("@")
    nodes = [h for h in hosts.split(",") if h]
    if not nodes:
        raise ValueError(f"{redact_url(url)} names no cluster node: give host:port after {scheme}://")
    path = urlsplit(f"redis://x{sep}{tail}").path.strip("/")
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only; drop /{path} from {redact_url(url)}")
    seed = f"{CLUSTER_SCHEMES[scheme.lower()]}://{userinfo}{at}{nodes[0]}{sep}{tail}"
    return seed, [_host_port(n, url) for n in nodes[1:]]


def _host_port(node: str, url: str) -> tuple[str, int]:
    host, colon, port = node.rpartition(":") if not node.endswith("]") else (node, "", "")
    if not colon:
        host, port = node, str(DEFAULT_PORT)
    if not port.isdigit():
        raise ValueError(f"cluster node {node!r} in {redact_url(url)} is not host:port")
    return host.strip("[]"), int(port)


def check_server(client, url: str) -> None:
    """Reach the server now (a redis error if it cannot be reached). A one-server URL that names a node of
    a Redis Cluster is refused: its queues would be found only where their slots happen to live."""
    client.ping()
    if not isinstance(client, RedisCluster) and client.info("cluster").get("cluster_enabled"):
        host = urlsplit(url).netloc.rpartition("@")[2]
        raise ValueError(f"{redact_url(url)} is a node of a Redis Cluster: use redis+cluster://{host} "
                         "(with the password, if any)")


def own_connection(client, key: str, refresh: bool = False) -> redis.Redis:
    """A client with one connection of its own, to the server that holds `key` (in a cluster, the node that
    serves its slot): for a blocking call that another thread may end with CLIENT UNBLOCK, which must reach
    the same server (its `connection_pool`). refresh: ask the cluster where the slot is now (after a
    failover or a MOVED reply)."""
    if isinstance(client, RedisCluster):
        if refresh:
            try:
                client.nodes_manager.initialize()
            except RedisClusterException as e:  # no node answered: as if the connection were lost
                raise redis.ConnectionError(str(e)) from e
        pool = client.get_redis_connection(client.get_node_from_key(key)).connection_pool
    else:
        pool = client.connection_pool
    return redis.Redis(connection_pool=pool, single_connection_client=True)


def redact_url(url: str) -> str:
    """The URL as it may be printed or logged: its password (and a lone user part, often a password
    put there) replaced by ***, also a `password=` query field."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return re.sub(r"//[^/@\s]*@", "//***@", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}" if ":" in userinfo else f"***@{host}"
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    return urlunsplit(parts._replace(netloc=netloc, query=query))
