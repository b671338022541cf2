"""The JSON schema of the one user-facing config dict, and the docs tables generated from it.

Why generated: every key's type, bounds, default and meaning are declared once, on the config sections
(`StoreConfig`, the tier configs, the connectors' options: see `vllm_tiercache.shared.store.tier_config`);
the schema and the tables of docs/configuration.md are written from them, so the docs cannot drift from
the code (``tests/config/test_config_schema.py`` fails when they differ; ``make docs`` rewrites them).

This module knows the store; the connectors' option classes are passed in by the caller
(`vllm_tiercache.tools.config_cmd`), as the layers import only downward.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_tiercache.shared.config import CONFIG_FILE_SCHEMA, CONNECTOR_KEYS, StoreConfig
from vllm_tiercache.shared.store import registry
from vllm_tiercache.shared.store.tier_config import section_schema

#: The lines around the generated part of docs/configuration.md.
BEGIN = "<!-- BEGIN GENERATED SCHEMA -->"
END = "<!-- END GENERATED SCHEMA -->"
#: What regenerates it, as the docs and the failing test say.
REGENERATE = "make docs (or: tiercache config schema --update-docs docs/configuration.md)"
_X_KEYS = {"description": "Anything prefixed x_ that no connector owns: kept in StoreConfig.extra, for experiments. "
                          "Any other unknown key is an error that names the nearest known key."}


def config_schema(connectors: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of the whole dict: the store's keys, ``config_file``, ``x_*`` and each connector's
    options (``connectors``: connector name -> options class, as `CONNECTOR_KEYS` names them), with the
    tiers as a union told apart by ``kind``."""
    if set(connectors) != set(CONNECTOR_KEYS):
        raise ValueError(f"connectors {sorted(connectors)} are not those of CONNECTOR_KEYS {sorted(CONNECTOR_KEYS)}")
    store = section_schema(StoreConfig)
    properties = {**store["properties"], "config_file": CONFIG_FILE_SCHEMA}
    defs = dict(store.get("$defs", {}))
    for name, cls in connectors.items():
        part = section_schema(cls)
        if tuple(part["properties"]) != CONNECTOR_KEYS[name]:
            raise ValueError(f"{cls.__name__} declares {tuple(part['properties'])}, CONNECTOR_KEYS[{name!r}] "
                             f"{CONNECTOR_KEYS[name]}")
        properties.update(part["properties"])
        defs.update(part.get("$defs", {}))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "vllm-tiercache config",
        "description": ("The one dict of kv_connector_extra_config and ec_connector_extra_config (or of a "
                        "config_file, or $TIERCACHE_CONFIG): the store's keys and each connector's options "
                        "side by side. " + "; ".join(f"{name}: {', '.join(keys)}"
                                                      for name, keys in CONNECTOR_KEYS.items()) + "."),
        "type": "object",
        "properties": properties,
        "patternProperties": {"^x_": _X_KEYS},
        "additionalProperties": False,
        "$defs": defs,
    }


# ---------------------------------------------------------------------------------------------- docs
def docs_section(schema: Mapping[str, Any], sections: Sequence[tuple[str, Any]],
                 more: Sequence[tuple[str, Any]] = ()) -> str:
    """The generated part of docs/configuration.md (markers included): one table per section of the
    whole ``schema`` (``sections``: title and class; its keys are looked up in ``schema``), one per tier
    kind, one per class of ``more`` (a schema of its own), then the raw JSON."""
    out = [BEGIN, f"<!-- Generated from the config classes by {REGENERATE}; do not edit by hand. -->", ""]
    props = schema["properties"]
    for title, cls in sections:
        own = section_schema(cls)
        keys = list(own["properties"])
        if cls is StoreConfig:
            keys.append("config_file")
        rows = [_row(key, props[key], False) for key in keys]
        if cls is StoreConfig:
            rows.append(_row("x_*", schema["patternProperties"]["^x_"], False))
        out += _table(title, cls, own.get("description", ""), rows)
    for ref in _tier_refs(props["tiers"]):
        tier = schema["$defs"][ref]
        kind = tier["properties"]["kind"]["const"]
        rows = [_row(k, p, k in tier.get("required", ())) for k, p in tier["properties"].items()]
        rows += [_row(pattern.strip("^") + "*", p, False) for pattern, p in tier.get("patternProperties", {}).items()]
        out += _table(f"Tier `kind: {kind}`", registry.config_class(kind), tier.get("description", ""), rows)
    for title, cls in more:
        own = section_schema(cls)
        rows = [_row(k, p, k in own.get("required", ())) for k, p in own["properties"].items()]
        out += _table(title, cls, own.get("description", ""), rows)
    out += ["<details><summary>The JSON schema of the whole config (<code>tiercache config schema</code>)</summary>",
            "", "```json", json.dumps(schema, indent=2), "```", "", "</details>", END]
    return "\n".join(out) + "\n"


def replace_generated(text: str, section: str) -> str:
    """``text`` with the part between `BEGIN` and `END` (markers included) replaced by ``section``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.find(BEGIN) > text.find(END):
        raise ValueError(f"expected one {BEGIN!r} line, then one {END!r} line")
    start, end = text.find(BEGIN), text.find(END)
    return text[:start] + section + text[end + len(END):].removeprefix("\n")


def generated_part(text: str) -> str | None:
    """The part of ``text`` between the markers (included, with its newline), or None without them."""
    start, end = text.find(BEGIN), text.find(END)
    return text[start:end + len(END)] + "\n" if 0 <= start < end else None


def _tier_refs(tiers: Mapping[str, Any]) -> list[str]:
    """The tier kinds' $defs names, in the order of the union (fastest kinds first)."""
    return [item["$ref"].rsplit("/", 1)[-1] for item in tiers["items"]["oneOf"]]


def _table(title: str, cls: Any, description: str, rows: list[str]) -> list[str]:
    return [f"### {title}", "", f"`{cls.__name__}`, `{_source(cls)}`: {_text(description)}", "",
            "| key | type | default | allowed | meaning |", "|---|---|---|---|---|", *rows, ""]


def _source(cls: Any) -> str:
    return cls.__module__.removeprefix("vllm_tiercache.").replace(".", "/") + ".py"


def _row(key: str, prop: Mapping[str, Any], required: bool) -> str:
    default = "required" if required else _value(prop["default"], prop) if "default" in prop else ""
    cells = [f"`{key}`", _type(prop), default, _allowed(prop), _text(prop.get("description", ""))]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _text(text: str) -> str:
    return " ".join(text.split())


_TYPES = {"integer": "int", "number": "number", "string": "string", "boolean": "bool", "null": "null",
          "object": "mapping", "array": "list"}


def _type(prop: Mapping[str, Any]) -> str:
    if "$ref" in prop:  # a section of its own, with a table of its own
        return "mapping"
    if prop.get("format") == "size":
        return "size"
    if "anyOf" in prop:
        return " or ".join(dict.fromkeys(_type(p) for p in prop["anyOf"]))
    if prop.get("type") == "array":
        items = prop.get("items", {})
        return "list of tiers" if "oneOf" in items else f"list of {_type(items)}"
    return _TYPES.get(prop.get("type", ""), "any")


def _allowed(prop: Mapping[str, Any]) -> str:
    if "$ref" in prop:
        return f"the keys of `{prop['$ref'].rsplit('/', 1)[-1]}` (its table below)"
    if "const" in prop:
        return _value(prop["const"], prop)
    if "enum" in prop:
        return ", ".join(_value(v, prop) for v in prop["enum"])
    if prop.get("format") == "size":
        number = prop["anyOf"][0]
        return f'{_bytes(number["minimum"])} to {_bytes(number["maximum"])}: bytes, or a string such as "8GiB"'
    if "anyOf" in prop:
        if not any(_allowed(p) for p in prop["anyOf"] if p.get("type") != "null"):
            return ""  # the type says it all
        return " or ".join(_allowed(p) or _type(p) for p in prop["anyOf"])
    low, high = prop.get("minimum"), prop.get("maximum")
    if prop.get("type") == "integer" and "exclusiveMinimum" in prop:
        low = prop["exclusiveMinimum"] + 1
    parts = [f"more than {_num(prop['exclusiveMinimum'])}"] if "exclusiveMinimum" in prop and low is None else []
    if low is not None and high is not None:
        parts.append(f"{_num(low)} to {_num(high)}")
    else:
        parts += [f"at least {_num(low)}"] if low is not None else []
        parts += [f"at most {_num(high)}"] if high is not None else []
    parts += [f"less than {_num(prop['exclusiveMaximum'])}"] if "exclusiveMaximum" in prop else []
    parts += [f"a multiple of {_num(prop['multipleOf'])}"] if "multipleOf" in prop else []
    parts += ["non-empty"] if prop.get("minLength") == 1 or prop.get("minItems") == 1 else []
    parts += [f"matching `{prop['pattern']}`"] if "pattern" in prop else []
    parts += [f"keys matching `{prop['propertyNames']['pattern']}`"] if "propertyNames" in prop else []
    parts += ["true, false"] if prop.get("type") == "boolean" else []
    return ", ".join(parts) if parts else "any" if "type" not in prop else ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _value(value: Any, prop: Mapping[str, Any]) -> str:
    if prop.get("format") == "size" and isinstance(value, int):
        return _bytes(value)
    return f"`{json.dumps(value)}`"


def _bytes(n: int) -> str:
    """``2 GiB``: a whole number of the largest binary unit that divides ``n``."""
    for shift, unit in ((60, "EiB"), (50, "PiB"), (40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
