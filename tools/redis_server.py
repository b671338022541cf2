"""`RedisServer`: a throwaway real redis-server on a free loopback port, for tests and benchmarks;
`LocalRedisCluster`: six of them formed into a real Redis Cluster (3 masters, 3 replicas).

Why a real server: the Redis tier's value is in pipelining, part splitting, TTLs, TLS, passwords and
surviving a server that dies; only a real server exercises those. The server keeps nothing on disk,
listens on 127.0.0.1 only and lives in its own temp dir. Likewise only a real cluster shows what
redis-py's cluster client does (slot routing, pipelines split per node, what it raises when a node or the
whole cluster is away).
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from vllm_tiercache.tools.binaries import find_binary, wait_stopped
from vllm_tiercache.tools.ports import free_port, free_port_pair

INSTALL_HINT = (
    "redis-server was not found. Install it (Debian/Ubuntu: `sudo apt-get install redis-server`; "
    "macOS: `brew install redis`; or `make redis`), or set TIERCACHE_REDIS_SERVER to the path of a "
    "redis-server binary."
)


class RedisServerError(RuntimeError):
    """redis-server is missing or did not start; the message says why and how to fix it."""


def find_redis_server() -> str:
    """Path of the redis-server binary: $TIERCACHE_REDIS_SERVER, else beside this Python, else PATH."""
    return find_binary("redis-server", "TIERCACHE_REDIS_SERVER", RedisServerError, INSTALL_HINT)





def _make_tls_files(directory: Path) -> dict[str, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1/localhost (cryptography package)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tiercache test CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = {"ca": directory / "ca.crt", "cert": directory / "server.crt", "key": directory / "server.key"}
    files["ca"].write_bytes(ca_cert.public_bytes(pem))
    files["cert"].write_bytes(cert.public_bytes(pem))
    files["key"].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL,
                                               serialization.NoEncryption()))
    os.chmod(files["key"], 0o600)
    return files


class RedisServer:
    """Start with ``with RedisServer() as srv:`` (or `start()`); ``srv.url`` is ready for redis-py."""

    def __init__(self, password: str | None = None, tls: bool = False, port: int | None = None,
                 startup_timeout: float = 10.0, extra_args: Sequence[str] = ()) -> None:
        self.binary = find_redis_server()
        self.password = password
        self.tls = tls
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self.extra_args = list(extra_args)
        self._tmp = tempfile.TemporaryDirectory(prefix="tiercache-redis-")
        self.dir = Path(self._tmp.name)
        self.tls_files = _make_tls_files(self.dir) if tls else {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    # ------------------------------------------------------------------------------------------ info
    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = f":{self.password}@" if self.password else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    @property
    def ssl_kwargs(self) -> dict[str, Any]:
        """redis-py / tier config options a TLS client needs to trust this server."""
        return {"ssl_ca_certs": str(self.tls_files["ca"])} if self.tls else {}

    def saved_dump(self, timeout_s: float = 30.0, dbfilename: str = "dump.rdb") -> bytes:
        """BGSAVE, wait (at most ``timeout_s``) until the dump holds every change, and read the dump file: what
        a backup of this server holds (a server started with ``--save`` and that ``--dbfilename``)."""
        with self.client() as client:
            client.bgsave()
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                info = client.info("persistence")
                if not info["rdb_bgsave_in_progress"] and info["rdb_changes_since_last_save"] == 0:
                    break
                time.sleep(0.05)
            assert info["rdb_last_bgsave_status"] == "ok" and info["rdb_changes_since_last_save"] == 0, info
        return (self.dir / dbfilename).read_bytes()

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url, **self.ssl_kwargs, **kwargs)

    # ------------------------------------------------------------------------------------ lifecycle
    def _args(self) -> list[str]:
        args = [self.binary, "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no",
                "--logfile", str(self.dir / "redis.log"), "--databases", "16"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.tls_files["cert"]),
                     "--tls-key-file", str(self.tls_files["key"]),
                     "--tls-ca-cert-file", str(self.tls_files["ca"]), "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        return args + self.extra_args

    def start(self) -> RedisServer:
        if self.running:
            return self
        self.proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace")
                log_file = self.dir / "redis.log"
                log_text = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                raise RedisServerError(f"redis-server exited with {self.proc.returncode} on port "
                                       f"{self.port}: {err or log_text}")
            try:
                with self.client(socket_connect_timeout=0.5, socket_timeout=0.5) as c:
                    if c.ping():
                        return self
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.02)
        self.kill()
        raise RedisServerError(f"redis-server on 127.0.0.1:{self.port} did not answer PING within "
                               f"{self.startup_timeout}s (last error: {last})")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung or partitioned server)."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True
            wait_stopped(self.proc.pid)  # answers nothing from now on, not from when the signal lands

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if self.running and self.paused:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc is None:
            return
        self.resume()  # a stopped process would not act on SIGTERM
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reap()

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed server would die."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._reap()

    def _reap(self) -> None:
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        self.paused = False

    def restart(self) -> RedisServer:
        """Stop (if running) and start again on the same port, empty (nothing is persisted)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, tls={self.tls}, password={'set' if self.password else None})"


# ------------------------------------------------------------------------------------------ cluster
@contextmanager
def optional_redis_url(needed: bool) -> Iterator[str | None]:
    """A throwaway local redis-server's URL for the benchmarks' Redis cases, or None when none needs one."""
    if not needed:
        yield None
        return
    with RedisServer() as server:
        yield server.url


def find_redis_cli(server_binary: str) -> str:
    """redis-cli beside the redis-server binary in use, else on PATH (it forms the cluster)."""
    beside = Path(server_binary).with_name("redis-cli")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("redis-cli")
    if not found:
        raise RedisServerError(f"redis-cli was not found beside {server_binary} nor on PATH. {INSTALL_HINT}")
    return found


def _free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (port + 10000) is free too, both below the ephemeral range
    (`vllm_tiercache.tools.ports` says why)."""
    return free_port_pair(taken)


def _info_fields(text: str) -> dict[str, str]:
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class LocalRedisCluster:
    """A real Redis Cluster on loopback: ``masters`` masters with ``replicas`` replica each (3 + 3).

    ``with LocalRedisCluster() as cluster:`` starts six ``redis-server --cluster-enabled yes``, forms
    the cluster with ``redis-cli --cluster create`` and waits until every node says
    ``cluster_state:ok`` and every replica is in sync. ``cluster.url`` is the tier URL
    (``redis+cluster://127.0.0.1:PORT``, node 0 as the seed). Nodes are addressed by index into
    ``nodes``; `kill` / `pause` / `resume` act on one, `stop` on all, and `start` brings back whatever
    was stopped, killed or paused (each node keeps its ``nodes.conf``, so it rejoins as itself, or as a
    replica when its replica was promoted meanwhile; data is not persisted). For failover tests:
    `replica_of`, `wait_replicated` (before a kill), `wait_promoted` (after it), `config_set`.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 5000,
                 startup_timeout: float = 30.0) -> None:
        self.masters_count = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.startup_timeout = startup_timeout
        taken: set[int] = set()
        self.nodes: list[RedisServer] = []
        for _ in range(masters * (1 + replicas)):
            port = _free_cluster_port(taken)
            taken |= {port, port + 10000}
            self.nodes.append(RedisServer(port=port, extra_args=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                "--repl-diskless-sync-delay", "0"]))  # replicas in sync at once, not after 5 s
        self.cli = find_redis_cli(self.nodes[0].binary)
        self._created = False

    # ------------------------------------------------------------------------------------------ info
    @property
    def url(self) -> str:
        return self.url_for(0)

    def url_for(self, node: int) -> str:
        """The tier URL with ``nodes[node]`` as the seed."""
        return f"redis+cluster://127.0.0.1:{self.nodes[node].port}"

    @property
    def seeds_url(self) -> str:
        """The tier URL with every node as a seed (the client learns the cluster from the first that answers)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def client(self, **kwargs: Any) -> Any:
        """A redis-py `RedisCluster` on this cluster (for tests to inspect or damage records)."""
        from redis.cluster import RedisCluster

        live = next(n for n in self.nodes if n.running and not n.paused)
        return RedisCluster(host="127.0.0.1", port=live.port, **kwargs)

    def node_client(self, node: int, **kwargs: Any) -> redis.Redis:
        """A plain client on one node (no redirects): CLUSTER, INFO, ROLE, FLUSHALL there."""
        return self.nodes[node].client(socket_connect_timeout=1, socket_timeout=2, **kwargs)

    def role(self, node: int) -> str:
        """"master" or "slave", as the node itself says."""
        with self.node_client(node) as c:
            return c.execute_command("ROLE")[0].decode()

    def master_nodes(self) -> list[int]:
        """Indexes of the running, unpaused nodes that are masters now."""
        return [i for i, n in enumerate(self.nodes) if n.running and not n.paused and self.role(i) == "master"]

    def node_of(self, key: str | bytes) -> int:
        """Index of the master serving ``key``'s slot now."""
        live = next(i for i, n in enumerate(self.nodes) if n.running and not n.paused)
        with self.node_client(live) as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
        for i in self.master_nodes():
            with self.node_client(i) as c:
                if self._serves(c, slot):
                    return i
        raise RedisServerError(f"no live master serves slot {slot}")

    @staticmethod
    def _serves(c: redis.Redis, slot: int) -> bool:
        myself = next(line for line in c.execute_command("CLUSTER", "NODES").decode().splitlines()
                      if "myself" in line)
        for spec in myself.split()[8:]:
            if spec.startswith("["):
                continue  # a slot being imported or migrated
            lo, _, hi = spec.partition("-")
            if int(lo) <= slot <= int(hi or lo):
                return True
        return False

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> LocalRedisCluster:
        """Start (and, the first time, form) the cluster; bring back stopped, killed or paused nodes."""
        for node in self.nodes:
            node.resume()
            node.start()
        if not self._created:
            self._create()
        self.wait_ok()
        return self

    def _create(self) -> None:
        args = [self.cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=self.startup_timeout)
        except subprocess.TimeoutExpired as exc:
            self.stop()
            raise RedisServerError(f"redis-cli --cluster create did not finish in {self.startup_timeout}s") from exc
        if done.returncode != 0:
            self.stop()
            raise RedisServerError(f"redis-cli --cluster create failed ({done.returncode}): "
                                   f"{(done.stdout + done.stderr)[-2000:]}")
        self._created = True

    def wait_ok(self, timeout: float | None = None) -> None:
        """Until every running node says cluster_state:ok, all slots assigned, every node known, and
        every replica's link to its master is up."""
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        last = ""
        while True:
            try:
                last = self._not_ok()
            except (redis.RedisError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if not last:
                return
            if time.monotonic() > deadline:
                raise RedisServerError(f"cluster on ports {self.ports} not ok after "
                                       f"{self.startup_timeout if timeout is None else timeout}s: {last}")
            time.sleep(0.1)

    def _not_ok(self) -> str:
        """Why the cluster is not ready yet ('' when it is)."""
        total = len(self.nodes)
        for i, node in enumerate(self.nodes):
            if not node.running or node.paused:
                return f"node {i} (port {node.port}) is not running"
            with self.node_client(i) as c:
                info = _info_fields(c.execute_command("CLUSTER", "INFO").decode())
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_assigned") != "16384" \
                        or info.get("cluster_known_nodes") != str(total):
                    return f"node {i} (port {node.port}): " + ", ".join(
                        f"{k}={info.get(k)}" for k in ("cluster_state", "cluster_slots_assigned",
                                                       "cluster_known_nodes"))
                repl = c.info("replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return f"node {i} (port {node.port}): replica link {repl.get('master_link_status')}"
        return ""

    def flushall(self) -> None:
        """Empty every master (replicas follow)."""
        for i in self.master_nodes():
            with self.node_client(i) as c:
                c.flushall()

    def kill(self, node: int) -> None:
        """SIGKILL one node, as a crash or the OOM killer would."""
        self.nodes[node].kill()

    def pause(self, node: int) -> None:
        """SIGSTOP one node: connected, silent (a hung host or a partition)."""
        self.nodes[node].pause()

    def resume(self, node: int) -> None:
        self.nodes[node].resume()

    def replica_of(self, node: int) -> int:
        """Index of a running replica of ``nodes[node]``, as the replicas say."""
        port = self.nodes[node].port
        for i, n in enumerate(self.nodes):
            if i == node or not n.running or n.paused:
                continue
            with self.node_client(i) as c:
                repl = c.info("replication")
            if repl.get("role") == "slave" and int(repl.get("master_port", 0)) == port:
                return i
        raise RedisServerError(f"node {node} (port {port}) has no running replica")

    def wait_promoted(self, node: int, timeout: float = 60.0, poll_s: float = 0.02) -> float:
        """Until ``nodes[node]`` (the replica of a master that failed) says it is a master that serves
        slots; returns the seconds waited. The failover needs ``node_timeout_ms`` to mark the master
        failed, then about a second for the replica's election."""
        start = time.monotonic()
        while True:
            try:
                with self.node_client(node) as c:
                    if c.execute_command("ROLE")[0] == b"master" and self._owns_slots(c):
                        return time.monotonic() - start
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() - start > timeout:
                raise RedisServerError(f"node {node} (port {self.nodes[node].port}) was not promoted in {timeout}s")
            time.sleep(poll_s)

    @staticmethod
    def _owns_slots(c: redis.Redis) -> bool:
        myself = next(line for line in c.execute_command("CLUSTER", "NODES").decode().splitlines()
                      if "myself" in line)
        return any(not spec.startswith("[") for spec in myself.split()[8:])

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Until every running master's replicas have every write it had when this was called (their
        replication offsets), so that a failover from now on loses none of those writes."""
        goals = []
        for i in self.master_nodes():
            with self.node_client(i) as c:
                goals.append((i, int(c.info("replication")["master_repl_offset"])))
        deadline = time.monotonic() + timeout
        for i, offset in goals:
            while True:
                with self.node_client(i) as c:
                    repl = c.info("replication")
                replicas = [v for k, v in repl.items() if k.startswith("slave") and isinstance(v, dict)]
                if replicas and all(int(r.get("offset", -1)) >= offset for r in replicas):
                    break
                if time.monotonic() > deadline:
                    raise RedisServerError(f"node {i}'s replicas did not reach offset {offset} in {timeout}s: "
                                           f"{replicas}")
                time.sleep(0.01)

    def config_set(self, name: str, value: str) -> None:
        """CONFIG SET on every running node (e.g. ``cluster-require-full-coverage no``); a node started
        later runs with its command-line settings again."""
        for i, n in enumerate(self.nodes):
            if n.running and not n.paused:
                with self.node_client(i) as c:
                    c.config_set(name, value)

    def stop(self) -> None:
        """Stop every node (the whole cluster is down until `start`)."""
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalRedisCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalRedisCluster(ports={self.ports})"
