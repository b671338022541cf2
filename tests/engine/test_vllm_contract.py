"""The contract with the installed vLLM: interfaces implemented as its base classes declare them, and the
configuration rules enforced where vLLM's own scheduler builds the connector.

Why: the connectors subclass vLLM interfaces that are not stable API. A release that adds an abstract
method or renames a parameter would otherwise surface as a crash deep in a running engine; here it fails
as a named test against whichever vLLM is installed (run it in a venv with the next release before
widening `vllm_tiercache.shared.vllm_compat.SUPPORTED_RANGE`).

The scheduler-level tests build vLLM's real `Scheduler` (as vLLM's own tests/v1/kv_connector/unit do) on
the project's tiny Llama, with `TieredKVConnector` named in the `KVTransferConfig`.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ECTransferConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.sched.scheduler import Scheduler

from tests.support.real_scheduler import real_scheduler
from vllm_tiercache.eccache.connector import TieredECConnector
from vllm_tiercache.eccache.managers import (
    LFUEncoderCacheManager,
    LRUEncoderCacheManager,
    PolicyEncoderCacheManager,
    WTinyLFUEncoderCacheManager,
)
from vllm_tiercache.kvcache.connector import TieredKVConnector, resolve_load_failure_policy
from vllm_tiercache.shared import vllm_compat
from vllm_tiercache.shared.config import ConfigError

PAIRS: list[tuple[type, type]] = [
    (TieredKVConnector, KVConnectorBase_V1),
    (TieredECConnector, ECConnectorBase),
    (PolicyEncoderCacheManager, EncoderCacheManager),
    (LRUEncoderCacheManager, EncoderCacheManager),
    (LFUEncoderCacheManager, EncoderCacheManager),
    (WTinyLFUEncoderCacheManager, EncoderCacheManager),
]
IDS = [f"{ours.__name__}-{base.__name__}" for ours, base in PAIRS]


# ------------------------------------------------------------------------------------ signatures
def _callable_of(cls: type, name: str) -> Any:
    """The function behind attribute `name` of `cls` (unwrapping classmethod / staticmethod / property)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            attr = vars(klass)[name]
            if isinstance(attr, classmethod | staticmethod):
                return attr.__func__
            if isinstance(attr, property):
                return attr.fget
            return attr
    raise AttributeError(name)


def signature_problems(base_fn: Any, ours_fn: Any) -> list[str]:
    """Why `ours_fn` cannot stand in for `base_fn` when vLLM calls it as the base declares; [] if it can.

    Every parameter of the base must be accepted under the same name and a compatible kind (positional
    callers and keyword callers both work), and any extra parameter of ours must be optional.
    """
    base = inspect.signature(base_fn).parameters
    ours = inspect.signature(ours_fn).parameters
    ours_list = list(ours.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in ours_list)
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in ours_list)
    problems: list[str] = []
    ours_positional = [p.name for p in ours_list if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    base_positional = [p.name for p in base.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, (name, param) in enumerate(base.items()):
        if param.kind is param.VAR_POSITIONAL:
            if not var_pos:
                problems.append(f"base takes *{name}, ours does not")
            continue
        if param.kind is param.VAR_KEYWORD:
            if not var_kw:
                problems.append(f"base takes **{name}, ours does not")
            continue
        if name not in ours:
            if not (param.kind is param.KEYWORD_ONLY and var_kw):
                problems.append(f"parameter {name!r} missing")
            continue
        mine = ours[name]
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            position = base_positional.index(name)
            if name not in ours_positional or ours_positional.index(name) != position:
                problems.append(f"parameter {name!r} is not positional at index {index}")
        if param.default is not param.empty and mine.default is mine.empty:
            problems.append(f"parameter {name!r} is optional in the base but required in ours")
    for name, mine in ours.items():
        if name in base or mine.kind in (mine.VAR_POSITIONAL, mine.VAR_KEYWORD):
            continue
        if mine.default is mine.empty:
            problems.append(f"extra parameter {name!r} has no default")
    return problems


@pytest.mark.parametrize(("ours", "base"), PAIRS, ids=IDS)
def test_every_abstract_method_is_implemented(ours: type, base: type) -> None:
    assert issubclass(ours, base)
    abstract = set(getattr(base, "__abstractmethods__", set()))
    assert not (abstract & set(getattr(ours, "__abstractmethods__", set()))), (
        f"{ours.__name__} leaves abstract: {sorted(abstract & set(ours.__abstractmethods__))}"
    )
    for name in abstract:
        assert _callable_of(ours, name) is not _callable_of(base, name), f"{ours.__name__}.{name} not implemented"


@pytest.mark.parametrize(("ours", "base"), PAIRS, ids=IDS)
def test_overridden_methods_keep_the_base_signature(ours: type, base: type) -> None:
    checked = 0
    problems: dict[str, list[str]] = {}
    for name in dir(base):
        if name.startswith("__") and name != "__init__":
            continue
        try:
            base_fn, ours_fn = _callable_of(base, name), _callable_of(ours, name)
        except AttributeError:
            continue
        if base_fn is ours_fn or not callable(base_fn) or not callable(ours_fn):
            continue
        if isinstance(inspect.getattr_static(base, name), property) != isinstance(
            inspect.getattr_static(ours, name), property
        ):
            problems[name] = ["property in one class, method in the other"]
            continue
        checked += 1
        found = signature_problems(base_fn, ours_fn)
        if found:
            problems[name] = found
    assert not problems, f"{ours.__name__} vs vLLM {vllm_compat.installed_vllm_version()} {base.__name__}: {problems}"
    assert checked > 0


def test_the_signature_check_catches_what_it_must() -> None:
    def base(self, request, blocks, num_external_tokens): ...
    def renamed(self, request, blocks, num_tokens): ...
    def extra_required(self, request, blocks, num_external_tokens, more): ...
    def extra_optional(self, request, blocks, num_external_tokens, num_computed_tokens=None): ...
    def swapped(self, blocks, request, num_external_tokens): ...

    assert signature_problems(base, extra_optional) == []
    assert signature_problems(base, renamed)
    assert signature_problems(base, extra_required)
    assert signature_problems(base, swapped)


def test_installed_vllm_is_in_the_verified_range() -> None:
    version = vllm_compat.installed_vllm_version()
    assert vllm_compat.is_supported_version(version), f"vLLM {version} is outside {vllm_compat.SUPPORTED_RANGE}"
    assert vllm_compat.is_supported_version("0.32.0") and vllm_compat.is_supported_version("0.33.1.dev4+gabc")
    assert not vllm_compat.is_supported_version("0.31.9") and not vllm_compat.is_supported_version("0.34.0")


def test_a_vllm_outside_the_range_gets_one_warning_naming_both(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(vllm_compat, "installed_vllm_version", lambda: "0.34.0")
    vllm_compat.check_vllm_version.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=vllm_compat.__name__):
            assert vllm_compat.check_vllm_version("TieredKVConnector") is False
            assert vllm_compat.check_vllm_version("TieredKVConnector") is False
        warnings = [r.getMessage() for r in caplog.records if r.name == vllm_compat.__name__]
        assert len(warnings) == 1
        assert "vLLM 0.34.0" in warnings[0] and vllm_compat.SUPPORTED_RANGE in warnings[0]
    finally:
        vllm_compat.check_vllm_version.cache_clear()


def test_the_gpu_extra_pins_the_verified_range() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'gpu = ["vllm{vllm_compat.SUPPORTED_RANGE}"]' in text


# --------------------------------------------------------------------- kv_load_failure_policy rules
@pytest.mark.parametrize(
    ("vllm_policy", "explicit", "option", "expected"),
    [
        ("fail", False, None, "recompute"),  # nobody said: the connector's default
        ("fail", False, "fail", "fail"),
        ("fail", False, "recompute", "recompute"),
        ("fail", True, None, "fail"),  # the user's vLLM setting wins
        ("recompute", True, None, "recompute"),
        ("recompute", True, "recompute", "recompute"),
        ("fail", True, "fail", "fail"),
    ],
)
def test_load_failure_policy_resolution(vllm_policy: str, explicit: bool, option: str | None, expected: str) -> None:
    assert resolve_load_failure_policy(vllm_policy, explicit, option) == expected


@pytest.mark.parametrize(("vllm_policy", "option"), [("fail", "recompute"), ("recompute", "fail")])
def test_a_load_failure_policy_conflict_names_both_settings(vllm_policy: str, option: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_load_failure_policy(vllm_policy, True, option)
    message = str(err.value)
    assert f"KVTransferConfig.kv_load_failure_policy={vllm_policy!r}" in message
    assert f"kv_connector_extra_config.load_failure_policy={option!r}" in message
    assert "Set one of them" in message


def test_explicitness_of_a_vllm_setting() -> None:
    plain = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both")
    assert not vllm_compat.is_explicitly_set(plain, "kv_load_failure_policy")
    other = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both", kv_load_failure_policy="recompute")
    assert vllm_compat.is_explicitly_set(other, "kv_load_failure_policy")
    tracked = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both", kv_load_failure_policy="fail")
    if vllm_compat.explicit_fields(tracked) is None:  # 0.32/0.33: pydantic dataclasses record no set fields
        object.__setattr__(tracked, "__pydantic_fields_set__", {"kv_connector", "kv_role", "kv_load_failure_policy"})
    assert vllm_compat.is_explicitly_set(tracked, "kv_load_failure_policy")


# ---------------------------------------------------------------------------- real vLLM Scheduler
def _kv_transfer(tmp_path: Path, *, option: str | None = None, **vllm_fields: Any) -> KVTransferConfig:
    extra: dict[str, Any] = {
        "namespace": "contract",
        "tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "16MiB"}],
    }
    if option is not None:
        extra["load_failure_policy"] = option
    return KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="vllm_tiercache.kvcache.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        **vllm_fields,
    )


def _vllm_config(model: Path, kv: KVTransferConfig, ec: ECTransferConfig | None = None) -> VllmConfig:
    model_config = ModelConfig(model=str(model), dtype="bfloat16", seed=0, max_model_len=1024)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        kv_transfer_config=kv,
        ec_transfer_config=ec,
        device_config=DeviceConfig("cpu"),
    )


def _scheduler(vllm_config: VllmConfig, num_blocks: int = 64) -> Scheduler:
    """vLLM's own Scheduler: it builds the connector (role SCHEDULER) and reads its settings back."""
    return real_scheduler(vllm_config, num_blocks)


def _shutdown(scheduler: Scheduler) -> None:
    for connector in (scheduler.connector, scheduler.ec_connector):
        if connector is not None:
            connector._store.close()


def test_scheduler_default_policy_is_the_connectors_recompute(tiny_llama: Path, tmp_path: Path) -> None:
    scheduler = _scheduler(_vllm_config(tiny_llama, _kv_transfer(tmp_path)))
    assert isinstance(scheduler.connector, TieredKVConnector)
    assert scheduler.recompute_kv_load_failures is True
    assert scheduler.requires_kv_delivery is False  # best-effort cache: nothing to hand off
    _shutdown(scheduler)


def test_scheduler_option_fail_reaches_vllm(tiny_llama: Path, tmp_path: Path) -> None:
    scheduler = _scheduler(_vllm_config(tiny_llama, _kv_transfer(tmp_path, option="fail")))
    assert scheduler.recompute_kv_load_failures is False
    assert scheduler.vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
    _shutdown(scheduler)


def test_scheduler_explicit_vllm_fail_survives_construction(tiny_llama: Path, tmp_path: Path) -> None:
    """The user's explicit `kv_load_failure_policy="fail"` is what vLLM's scheduler ends up using."""
    kv = _kv_transfer(tmp_path, kv_load_failure_policy="fail")
    if vllm_compat.explicit_fields(kv) is None:
        # vLLM 0.32/0.33 cannot record it (see vllm_tiercache.shared.vllm_compat.explicit_fields); a vLLM that does is
        # simulated by what pydantic would record.
        object.__setattr__(kv, "__pydantic_fields_set__", {"kv_connector", "kv_connector_module_path", "kv_role",
                                                           "kv_connector_extra_config", "kv_load_failure_policy"})
    scheduler = _scheduler(_vllm_config(tiny_llama, kv))
    assert scheduler.vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
    assert scheduler.recompute_kv_load_failures is False
    _shutdown(scheduler)


def test_command_line_sets_reads_every_spelling_of_the_flag() -> None:
    sets = vllm_compat.command_line_sets
    name = "kv_load_failure_policy"
    assert sets("kv-transfer-config", name, ["x", "--kv-transfer-config", '{"kv_load_failure_policy": "fail"}'])
    assert sets("kv-transfer-config", name, ["x", '--kv_transfer_config={"kv_load_failure_policy":"fail"}'])
    assert sets("kv-transfer-config", name, ["x", "--kv-transfer-config.kv_load_failure_policy", "fail"])
    assert sets("kv-transfer-config", name, ["x", "--kv-transfer-config.kv_load_failure_policy=fail"])
    assert not sets("kv-transfer-config", name, ["x", "--kv-transfer-config", '{"kv_role": "kv_both"}'])
    assert not sets("kv-transfer-config", name, ["x", "--kv-transfer-config", "not json"])
    assert not sets("kv-transfer-config", name, ["x", "--kv-transfer-config"])
    assert not sets("kv-transfer-config", name, ["x", "--ec-transfer-config", '{"kv_load_failure_policy": 1}'])


def test_scheduler_explicit_fail_on_the_launch_command_survives(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--kv-transfer-config '{..., "kv_load_failure_policy": "fail"}'`: the engine processes keep the server's
    argv, which records the explicit default that vLLM 0.32/0.33's config objects cannot."""
    kv = _kv_transfer(tmp_path, kv_load_failure_policy="fail")
    flag = json.dumps({"kv_connector": "TieredKVConnector", "kv_load_failure_policy": "fail"})
    monkeypatch.setattr(sys, "argv", ["vllm.entrypoints.openai.api_server", "--kv-transfer-config", flag])
    scheduler = _scheduler(_vllm_config(tiny_llama, kv))
    assert scheduler.recompute_kv_load_failures is False
    _shutdown(scheduler)
    monkeypatch.setattr(sys, "argv", ["python", "-m", "pytest"])  # nothing on the command line: our default
    scheduler = _scheduler(_vllm_config(tiny_llama, _kv_transfer(tmp_path / "b", kv_load_failure_policy="fail")))
    assert scheduler.recompute_kv_load_failures is True
    _shutdown(scheduler)


def test_scheduler_explicit_vllm_recompute_survives_and_agrees(tiny_llama: Path, tmp_path: Path) -> None:
    kv = _kv_transfer(tmp_path, option="recompute", kv_load_failure_policy="recompute")
    scheduler = _scheduler(_vllm_config(tiny_llama, kv))
    assert scheduler.recompute_kv_load_failures is True
    _shutdown(scheduler)


def test_scheduler_refuses_a_policy_conflict_with_both_settings_named(tiny_llama: Path, tmp_path: Path) -> None:
    kv = _kv_transfer(tmp_path, option="fail", kv_load_failure_policy="recompute")
    with pytest.raises(ConfigError, match=r"KVTransferConfig\.kv_load_failure_policy='recompute' but "
                                          r"kv_connector_extra_config\.load_failure_policy='fail'"):
        _scheduler(_vllm_config(tiny_llama, kv))


def _ec_transfer(tmp_path: Path, role: str) -> ECTransferConfig:
    return ECTransferConfig(
        ec_connector="TieredECConnector",
        ec_connector_module_path="vllm_tiercache.eccache.connector",
        ec_role=role,
        ec_connector_extra_config={"tiers": [{"kind": "disk", "path": str(tmp_path / "ec"), "capacity": "16MiB"}]},
    )


def test_scheduler_refuses_a_kv_connector_on_an_ec_producer(tiny_blip2: Path, tmp_path: Path) -> None:
    """`ec_producer` makes vLLM run the encoder only: the KV connector says so before anything starts."""
    ec = _ec_transfer(tmp_path, "ec_producer")
    vllm_config = _vllm_config(tiny_blip2, _kv_transfer(tmp_path), ec)
    assert vllm_compat.is_encode_only(vllm_config)
    with pytest.raises(ConfigError) as err:
        _scheduler(vllm_config)
    message = str(err.value)
    assert "ec_role='ec_producer'" in message and "ec_both" in message and "no KV cache" in message
    assert "drop kv_transfer_config on the encoder instance" in message


def test_an_ec_both_instance_keeps_its_kv_connector(tiny_blip2: Path, tmp_path: Path) -> None:
    ec = _ec_transfer(tmp_path, "ec_both")
    vllm_config = _vllm_config(tiny_blip2, _kv_transfer(tmp_path), ec)
    assert not vllm_compat.is_encode_only(vllm_config)
    scheduler = _scheduler(vllm_config)
    assert isinstance(scheduler.connector, TieredKVConnector)
    _shutdown(scheduler)
