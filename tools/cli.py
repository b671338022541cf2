"""`tiercache` command line: one dispatcher, each subcommand in the module that owns its feature.

A subcommand module defines `add_arguments(parser)` and `run(args) -> int`. Modules are imported only
when their command runs, so `tiercache --help` stays fast and never imports vLLM.

Exit status, for every command: 0 done; 1 done, but something failed (the output says what: a tier that
could not be read, an image that could not be stored); 2 the command could not start: a bad argument, a
wrong config, an unusable path. A status-2 error is one line on stderr, ``tiercache: error: ...``, never a
traceback: argparse errors come from `Parser`, the user errors the commands raise (`user_error_types`)
are caught in `main`. The ``type=`` validators below (`int_at_least`, `float_in`) give numeric options
their bounds at parse time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import math
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

#: The distribution whose version `tiercache --version` prints (pyproject.toml's ``[project] name``).
DISTRIBUTION = "vllm-tiercache"

#: command words -> (module under `vllm_tiercache.tools`, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("bench", "tiers"): ("bench.tiers", "put/get throughput per tier vs plain copy, file and redis-py"),
    ("bench", "kv"): ("bench.kv.command", "TTFT of KV-cache hits per tier vs vLLM's own prefix cache"),
    ("bench", "kv-step"): ("bench.kv.step", "the KV connector's own time per engine step while decoding, "
                                            "against the step"),
    ("bench", "kv-sched"): ("bench.kv.sched", "the scheduler's time per engine step while far lookups and fetches "
                                              "are pending, vs vLLM alone"),
    ("bench", "ec"): ("bench.ec", "encoder-cache policy hit rates and per-image load latency"),
    ("bench", "policy"): ("bench.policy", "eviction policies vs vLLM's encoder cache manager and Belady"),
    ("bench", "trace"): ("bench.trace.command", "KV hit ratio of the memory tier's policies on a Mooncake trace, "
                                                "vs LRU and the offline optimum, per capacity"),
    ("bench", "serve"): ("bench.serve.command", "concurrent multi-turn chat, working set > vLLM's KV cache: TTFT and "
                                        "throughput vs vLLM alone"),
    ("bench", "gpu"): ("bench.gpu.command", "CUDA movers, layerwise overlap and GDS reads vs the hardware "
                                            "(torch only)"),
    ("bench", "admission"): ("bench.admission", "admission to the slower tiers: bytes written to disk and Redis and "
                                                "repeated prompts' hits, on bench serve's trace with one-off prompts"),
    ("bench", "pins"): ("bench.pins", "a pinned document corpus against one-off prompts many times the memory "
                                      "tier: the corpus's hits with and without the pin"),
    ("bench", "pd"): ("bench.pd.command", "prefill/decode hand-off: decode TTFT vs a plain prefill, a resident hit and "
                                  "a raw redis-py read"),
    ("bench", "capacity"): ("bench.capacity", "object tier: peak usage against capacity while writer processes write "
                                              "many times it"),
    ("bench", "lookups"): ("bench.lookups", "object tier: a scheduler's lookup of N keys (HEADs, existence cache) "
                                            "against lookup_budget_ms"),
    ("bench", "route"): ("bench.route", "two instances on one Redis behind Dynamo's indexer: does the tiers' events "
                                        "routing pick the faster instance"),
    ("pd-proxy",): ("pd_proxy", "the prefill/decode proxy: prefill (kv_producer), then decode (kv_consumer) "
                                "with its kv_transfer_params"),
    ("demo",): ("demo", "the RAG demo: precompute, serve with both connectors, compare TTFT"),
    ("precompute", "images"): ("precompute.ec", "store encoder outputs of an image corpus (ec_producer)"),
    ("precompute", "docs"): ("precompute.kv", "store KV prefix chunks of a document corpus (kv_producer)"),
    ("identity",): ("identity_cmd", "the cache identity (weights digest, fingerprints) a server config uses"),
    ("stats",): ("stats_cmd", "entries, bytes and hit counters per tier and namespace"),
    ("evict",): ("evict_cmd", "remove records by namespace, model, age or tag (after a model or document update)"),
    ("pin",): ("pin_cmd", "keep the records of a tag through eviction, up to each tier's pin_budget"),
    ("unpin",): ("unpin_cmd", "end the pin of a tag"),
    ("config", "schema"): ("config_cmd", "the JSON schema of the config (or the docs tables made from it)"),
}


class UsageError(ValueError):
    """A command cannot run as asked (a missing filter, an unusable directory): `main` prints the message as
    one line, ``tiercache: error: <message>``, and exits with status 2."""


def writable_directory(directory: str | Path, option: str) -> Path:
    """``directory`` created if missing and checked writable; a `UsageError` naming ``option`` otherwise."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise UsageError(f"{option}: cannot use {str(path)!r} ({exc.strerror or exc}); allowed: a writable "
                         "directory (created if missing)") from None
    return path


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``tiercache: error: <what> (see <prog> --help)``, exit status 2.

    argparse prints the usage and then the error; a usage block hides the one line that matters, and the
    ``--help`` pointer says where the usage is.
    """

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument \{[^}]*\}: ", "", message)  # "invalid choice" names the choices itself
        self.exit(2, f"tiercache: error: {message} (see {self.prog} --help)\n")


class _VersionAction(argparse.Action):
    """``--version``: the installed version, looked up only when asked (not on every parser build)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        parser.exit(0, f"tiercache {version()}\n")


def version() -> str:
    """The installed version of the `vllm-tiercache` distribution ("unknown" when it is not installed)."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


# ------------------------------------------------------------------------------------ type= validators
def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """argparse ``type=``: an int in [minimum, maximum]; anything else is a one-line usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: an integer {bound}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[[str], float]:
    """argparse ``type=``: a finite number in the interval low..high (open ends where asked)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value > low if low_open else value >= low) \
            and (value < high if high_open else value <= high)
        if not ok:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a number in {interval}")
        return value

    parse.__name__ = "number"
    return parse


# ---------------------------------------------------------------------------------------- user errors
def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the command cannot run as asked": reported in one line, exit status 2.

    Config errors, precompute job errors, a tier that cannot be built (its path, its index), a private
    redis-server or SeaweedFS that cannot start (or is not installed) and a pin that cannot be checked
    against a tier. Classes are looked up only in modules already imported: an exception of a module that
    was never imported cannot have been raised, and `--help` stays free of heavy imports.
    """
    from vllm_tiercache.shared.store.tier_config import ConfigError

    types: list[type[BaseException]] = [ConfigError, UsageError, argparse.ArgumentTypeError]
    for module, name in (("vllm_tiercache.tools.jobs", "JobError"),
                         ("vllm_tiercache.shared.store.tiers.disk.tier", "DiskTierError"),
                         ("vllm_tiercache.tools.redis_server", "RedisServerError"),
                         ("vllm_tiercache.tools.s3_server", "SeaweedFSError"),
                         ("vllm_tiercache.tools.pin_cmd", "PinError")):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            types.append(cls)
    return tuple(types)


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (or its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


# ------------------------------------------------------------------------------------------- dispatch
def _build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tiercache", description="vllm-tiercache tools")
    parser.add_argument("--version", action=_VersionAction, help="print the installed version of vllm-tiercache "
                        "and exit")
    groups: dict[str, argparse._SubParsersAction] = {}
    top = parser.add_subparsers(dest="command", required=True)
    for words, (module, help_text) in COMMANDS.items():
        sub_parent = top
        for depth, word in enumerate(words[:-1]):
            prefix = " ".join(words[: depth + 1])
            if prefix not in groups:
                group_parser = sub_parent.add_parser(word, help=f"{word} commands")
                groups[prefix] = group_parser.add_subparsers(dest=f"command_{depth + 1}", required=True)
            sub_parent = groups[prefix]
        leaf = sub_parent.add_parser(words[-1], help=help_text)
        leaf.set_defaults(_module=module)
        leaf.set_defaults(_lazy_args=True)
    for action in (top, *groups.values()):  # errors name the choices, not the internal dest (command_1)
        action.metavar = "{" + ",".join(action.choices) + "}"
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        print(f"tiercache {version()}")
        return 0
    parser = _build_parser()
    # First pass, without -h: find which module owns the command; that module declares its own options.
    words = [arg for arg in argv if arg not in ("-h", "--help")]
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            known, _ = parser.parse_known_args(words)
    except SystemExit:
        known = None
    if known is None:
        parser.parse_args(argv)  # prints the help, or the one-line error for an unknown/incomplete command
        return 2
    depth = _command_depth(known)
    module = importlib.import_module(f"vllm_tiercache.tools.{known._module}")
    full = Parser(prog="tiercache " + " ".join(words[:depth]))
    module.add_arguments(full)
    args = full.parse_args(argv[depth:])
    try:
        return int(module.run(args) or 0)
    except Exception as exc:
        if not isinstance(exc, user_error_types()):
            raise
        print(f"tiercache: error: {one_line(exc)}", file=sys.stderr)
        return 2


def _command_depth(namespace: argparse.Namespace) -> int:
    return 1 + sum(1 for name in vars(namespace) if name.startswith("command_"))


if __name__ == "__main__":
    # `python -m vllm_tiercache.tools.cli`: run the package's module, not this `__main__` copy, so that the
    # subcommands' `UsageError` (imported from the package module) is the class `main` catches.
    from vllm_tiercache.tools.cli import main as package_main

    sys.exit(package_main())
