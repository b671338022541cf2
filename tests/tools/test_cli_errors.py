"""`tiercache` mistakes, as an operator makes them: one line on stderr (`tiercache: error: ...`), exit
status 2, never a traceback; and `tiercache --version`.

Why subprocesses: what the operator sees is the process's stderr and exit status; an exception that
`main` lets through shows as a traceback and status 1 there. The tables of bad values per option run
`cli.main` in this process instead (`tiercache_here`: same parser, same handler, same stderr line, an
escaped exception fails the test), about 2 CPU-s less each; every command family keeps a subprocess case.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from vllm_tiercache.tools import cli

REPO = Path(__file__).resolve().parents[2]


def tiercache(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_tiercache.tools.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def tiercache_here(*args: str) -> subprocess.CompletedProcess:
    """`cli.main(args)` in this process, as a `CompletedProcess` (argparse's exits become the status)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["tiercache", *args], code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc: subprocess.CompletedProcess, *pieces: str) -> str:
    """Exit status 2 and exactly one line on stderr, ``tiercache: error: ...`` holding every piece."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tiercache: error: "), lines[0]
    for piece in pieces:
        assert piece in lines[0], (piece, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------------ --version
def test_version_prints_the_installed_distribution_version(capsys) -> None:
    expected = metadata.version("vllm-tiercache")
    proc = tiercache("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"tiercache {expected}"
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tiercache {expected}"
    assert "--version" in tiercache("--help").stdout


# ----------------------------------------------------------------------------------------- bench tiers
@pytest.mark.parametrize(("args", "pieces"), [
    (["--repeat", "0"], ["--repeat", "invalid value '0'", "allowed: an integer from 1"]),
    (["--repeat", "many"], ["--repeat", "invalid value 'many'"]),
    (["--sizes", "1XB"], ["--sizes", "'1XB'", "allowed: comma-separated sizes"]),
    (["--sizes", ""], ["--sizes", "allowed: comma-separated sizes"]),
    (["--sizes", "0"], ["--sizes", "'0'", "from 1KiB to 1GiB"]),
    (["--tiers", "ssd"], ["--tiers", "'ssd'", "allowed: a comma-separated list of memory, disk, redis"]),
    (["--tiers", ""], ["--tiers", "allowed: a comma-separated list of memory, disk, redis"]),
    (["--tiers", "memory,nvme"], ["'nvme'", "memory, disk, redis"]),
    (["--redis-url", "http://cache:6379"], ["--redis-url", "redis://"]),
    (["--tiers", "memory", "--redis-cluster"], ["--redis-cluster", "allowed: with redis in --tiers"]),
], ids=["repeat-0", "repeat-many", "sizes-1XB", "sizes-empty", "sizes-0", "tiers-ssd", "tiers-empty",
        "tiers-nvme", "redis-url-http", "cluster-without-redis"])
def test_bench_tiers_bad_arguments(args: list[str], pieces: list[str]) -> None:
    assert_one_line_error(tiercache_here("bench", "tiers", *args), *pieces)


def test_bench_tiers_unusable_dir_and_unreachable_redis(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert_one_line_error(tiercache_here("bench", "tiers", "--tiers", "disk", "--dir", str(blocker / "sub")),
                          "--dir: cannot use", str(blocker / "sub"), "allowed: a writable directory")
    assert_one_line_error(tiercache_here("bench", "tiers", "--tiers", "redis", "--redis-url", "redis://127.0.0.1:1"),
                          "--redis-url: cannot reach redis://127.0.0.1:1")


# ------------------------------------------------------------------------------- other benchmarks, jobs
@pytest.mark.parametrize("args", [
    ["bench", "policy", "--requests", "100", "--images", "10", "--capacities", "0"],
    ["bench", "policy", "--requests", "3", "--images", "10"],
    ["bench", "policy", "--requests", "100", "--images", "10", "--exponents", "nan"],
    ["bench", "policy", "--requests", "100", "--images", "10", "--max-overlap", "0"],
    ["bench", "ec", "--repeats", "0", "--skip-policies"],
    ["precompute", "images", "--model", "m", "--images", "x", "--config", "{}", "--batch-size", "0"],
    ["precompute", "docs", "--model", "m", "--docs", "x", "--config", "{}", "--block-size", "-16"],
    ["bench", "route", "--docs", "1"],
    ["bench", "route", "--doc-tokens", "100"],
    ["precompute", "docs", "--model", "m", "--docs", "x", "--config", "{}", "--store-patience", "0"],
    ["precompute", "images", "--model", "m", "--images", "x", "--config", "{}", "--store-patience", "soon"],
], ids=["policy-capacities-0", "policy-requests-3", "policy-exponents-nan", "policy-max-overlap-0",
        "ec-repeats-0", "images-batch-size-0", "docs-block-size-negative", "route-docs-1", "route-doc-tokens-100",
        "docs-store-patience-0", "images-store-patience-word"])
def test_numeric_options_are_bounded(args: list[str]) -> None:
    assert_one_line_error(tiercache_here(*args), "invalid value", "allowed:")


def test_bench_kv_refuses_a_prompt_longer_than_the_models_positions(tmp_path: Path) -> None:
    """A model directory with 2,048 positions and 8K prompts: one line before any engine starts (the generated
    models are sized to the prompt instead)."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert_one_line_error(tiercache_here("bench", "kv", "--model", str(tmp_path), "--prompt-len", "8192"),
                          "--prompt-len 8192", "2048", "--model llama")
    assert_one_line_error(tiercache_here("bench", "kv", "--model", str(tmp_path / "none")), "config.json")


def test_bench_pins_and_admission_refuse_a_work_dir_they_cannot_use_and_pins_a_trace_without_one_offs(
        tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for bench in (["pins"], ["admission", "--no-redis"]):
        assert_one_line_error(tiercache_here("bench", *bench, "--work-dir", str(blocker / "sub")), "--work-dir:",
                              str(blocker))
    assert_one_line_error(tiercache_here("bench", "pins", "--one-off-share", "0"), "--one-off-share",
                          "give a share above 0")
    assert_one_line_error(tiercache_here("bench", "pins", "--pin-budget", "0.95"), "--pin-budget",
                          "invalid value '0.95'")


def test_bench_capacity_and_lookups_refuse_bad_sizes_and_counts_before_starting_anything() -> None:
    assert_one_line_error(tiercache_here("bench", "capacity", "--record-sizes", "2MiB-1MiB"), "--record-sizes",
                          "MIN at most MAX")
    assert_one_line_error(tiercache_here("bench", "capacity", "--capacities", "1MiB", "--record-sizes",
                                         "256KiB-2MiB"), "--record-sizes", "larger than the capacity")
    assert_one_line_error(tiercache_here("bench", "capacity", "--s3-endpoint", "http://127.0.0.1:1"),
                          "--s3-endpoint", "--s3-bucket")
    assert_one_line_error(tiercache_here("bench", "lookups", "--keys", "0,32"), "--keys", "from 1 to 100000")


@pytest.mark.parametrize("bench", ["lookups", "kv", "serve", "kv-sched"])
@pytest.mark.parametrize("value", ["-1", "10001", "20ms"])
def test_the_store_rtt_is_bounded_before_anything_starts(bench: str, value: str) -> None:
    assert_one_line_error(tiercache_here("bench", bench, "--store-rtt-ms", value), "--store-rtt-ms",
                          f"invalid value '{value}'", "allowed: a number in [0, 10000]")


def test_the_store_rtt_cannot_delay_a_tls_endpoint() -> None:
    """A proxy on 127.0.0.1 in front of https://host would fail the certificate's host check on every request:
    refused in one line instead, before any request."""
    assert_one_line_error(tiercache_here("bench", "lookups", "--s3-endpoint", "https://s3.example.com",
                                         "--s3-bucket", "b", "--store-rtt-ms", "20"),
                          "--store-rtt-ms: cannot delay the TLS endpoint https://s3.example.com")


@pytest.mark.parametrize(("job", "corpus", "extra", "pieces"), [
    ("docs", "a.txt", ["--pin"], ["--pin pins the tags given with --tag; add one, e.g. --tag corpus:v3"]),
    ("images", "a.png", ["--pin"], ["--pin pins the tags given with --tag"]),
    ("docs", "a.txt", ["--tag", "bad\ttag"], ["invalid tag 'bad\\ttag'", "allowed: a non-empty string"]),
    ("images", "a.png", ["--tag", ""], ["invalid tag ''"]),
], ids=["docs-pin-without-tag", "images-pin-without-tag", "docs-bad-tag", "images-empty-tag"])
def test_precompute_tags_and_pin_are_checked_before_any_engine(tmp_path: Path, job: str, corpus: str,
                                                               extra: list[str], pieces: list[str]) -> None:
    (tmp_path / corpus).write_text("x")
    proc = tiercache_here("precompute", job, "--model", "m", f"--{job}", str(tmp_path), "--config", "{}", *extra)
    assert_one_line_error(proc, *pieces)


def test_unknown_and_incomplete_commands() -> None:
    assert_one_line_error(tiercache_here(), "the following arguments are required", "see tiercache --help")
    assert_one_line_error(tiercache_here("bench", "nope"), "invalid choice: 'nope'", "see tiercache bench --help")
    assert_one_line_error(tiercache_here("stats", "--bogus", "1", "--config", "{}"), "unrecognized arguments: --bogus")


# -------------------------------------------------------------------------------------- stats, evict
def _unusable_disk(tmp_path: Path) -> str:
    """A store config whose disk tier's directory cannot be created (its parent is a regular file)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return json.dumps({"tiers": [{"kind": "disk", "path": str(blocker / "disk"), "capacity": "1GiB"}]})


def test_stats_and_evict_with_an_unusable_disk_path(tmp_path: Path) -> None:
    config = _unusable_disk(tmp_path)
    for command in (["stats"], ["evict", "--namespace", "a"], ["evict", "--older-than", "7d", "--dry-run"]):
        assert_one_line_error(tiercache_here(*command, "--config", config), "disk tier: cannot use",
                              str(tmp_path / "a-file" / "disk"))


@pytest.mark.parametrize(("args", "pieces"), [
    (["stats", "--config", '{"tiers": [{"kind": "memory", "capasity": "1GiB"}]}'],
     ["tiers[0].capasity: unknown key for a memory tier; did you mean 'capacity'?"]),
    (["stats", "--config", '{"tiers": [{"kind": "memory", "capacity": 0}]}'],
     ["tiers[0].capacity: invalid value 0", "at least 256 bytes"]),
    (["stats", "--config", "{not json"], ["--config: inline JSON is invalid"]),
    (["stats", "--config", "/nonexistent/store.yaml"], ["--config: cannot read"]),
    (["stats", "--config", '{"tiers": [{"kind": "memory"}]}', "--stats-dir", "/nonexistent/stats"],
     ["--stats-dir: '/nonexistent/stats' is not a directory"]),
    (["evict", "--config", '{"tiers": [{"kind": "memory"}]}'], ["give at least one of --namespace"]),
    (["evict", "--config", '{"tiers": [{"kind": "memory"}]}', "--older-than", "5x"],
     ["invalid duration '5x'; use e.g. 30m, 12h, 7d"]),
    (["evict", "--config", '{"tiers": [{"kind": "memory"}]}', "--namespace", ""], ["--namespace", "non-empty"]),
])
def test_stats_and_evict_usage_and_config_errors(args: list[str], pieces: list[str]) -> None:
    assert_one_line_error(tiercache_here(*args), *pieces)


def test_each_command_family_refuses_a_bad_value_in_its_own_process() -> None:
    """The in-process tables above, one case each through `python -m vllm_tiercache.tools.cli`."""
    assert_one_line_error(tiercache("bench", "tiers", "--repeat", "0"), "--repeat", "invalid value '0'")
    assert_one_line_error(tiercache("bench", "policy", "--requests", "3", "--images", "10"), "invalid value")
    assert_one_line_error(tiercache("precompute", "docs", "--model", "m", "--docs", "x", "--config", "{}",
                                    "--block-size", "-16"), "invalid value", "allowed:")
    assert_one_line_error(tiercache("stats", "--config", "{not json"), "--config: inline JSON is invalid")
    assert_one_line_error(tiercache("evict", "--config", '{"tiers": [{"kind": "memory"}]}'),
                          "give at least one of --namespace")


# ------------------------------------------------------------------------------------ the one handler
def test_main_turns_the_user_errors_into_one_line_and_status_2(monkeypatch, capsys) -> None:
    """Every command's user errors (config, job, tier, usage) are caught in one place, `cli.main`."""
    import types

    from vllm_tiercache.shared.config import ConfigError
    from vllm_tiercache.shared.store.tiers.disk.tier import DiskTierError
    from vllm_tiercache.tools.jobs import JobError

    raised: list[BaseException] = []
    fake = types.ModuleType("vllm_tiercache.tools.fake_cmd")
    fake.add_arguments = lambda parser: None  # type: ignore[attr-defined]

    def run(_args: argparse.Namespace) -> int:
        raise raised[-1]

    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_tiercache.tools.fake_cmd", fake)
    monkeypatch.setitem(cli.COMMANDS, ("fake",), ("fake_cmd", "a test command"))
    for exc in (ConfigError("tiers[0].capacity: invalid value 0; allowed: ..."), JobError("no engine"),
                DiskTierError("tiercache disk tier: cannot use /x"), cli.UsageError("two\nlines")):
        raised.append(exc)
        assert cli.main(["fake"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("tiercache: error: "), err
    assert "tiercache: error: two lines" in err
    raised.append(RuntimeError("a bug"))  # anything else is a bug: it keeps its traceback
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fake"])


def test_type_validators() -> None:
    at_least_one = cli.int_at_least(1)
    assert at_least_one("3") == 3
    for bad in ("0", "-1", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="allowed: an integer of at least 1"):
            at_least_one(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="from 1 to 10"):
        cli.int_at_least(1, 10)("11")
    fraction = cli.float_in(0.0, 1.0, low_open=True)
    assert fraction("1") == 1.0 and fraction("0.05") == 0.05
    for bad in ("0", "1.01", "nan", "inf", "-0.1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"allowed: a number in \(0, 1\]"):
            fraction(bad)
