"""`RedisServer`: a throwaway real redis-server on a free loopback port, for tests and benchmarks.

Why a real server: the Redis tier's value is in pipelining, part splitting, TTLs, TLS, passwords and
surviving a server that dies; only a real server exercises those. The server keeps nothing on disk,
listens on 127.0.0.1 only and lives in its own temp dir.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

INSTALL_HINT = (
    "redis-server was not found. Install it (Debian/Ubuntu: `sudo apt-get install redis-server`; "
    "macOS: `brew install redis`; or `make redis`), or set TIERCACHE_REDIS_SERVER to the path of a "
    "redis-server binary."
)


class RedisServerError(RuntimeError):
    """redis-server is missing or did not start; the message says why and how to fix it."""


def find_redis_server() -> str:
    """Path of the redis-server binary: $TIERCACHE_REDIS_SERVER, else PATH."""
    env = os.environ.get("TIERCACHE_REDIS_SERVER")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise RedisServerError(f"TIERCACHE_REDIS_SERVER={env!r} is not an executable file. {INSTALL_HINT}")
    found = shutil.which("redis-server")
    if not found:
        raise RedisServerError(INSTALL_HINT)
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                 startup_timeout: float = 10.0) -> None:
        self.binary = find_redis_server()
        self.password = password
        self.tls = tls
        self.port = port or _free_port()
        self.startup_timeout = startup_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="tiercache-redis-")
        self.dir = Path(self._tmp.name)
        self.tls_files = _make_tls_files(self.dir) if tls else {}
        self.proc: subprocess.Popen[bytes] | None = None

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
        return args

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

    def stop(self) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc is None:
            return
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
