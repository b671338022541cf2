"""`tiercache config schema`: the JSON schema of the config, or the docs tables generated from it.

Why here: the whole config is the store's keys and both connectors' options in one dict, and only this
layer may import both connectors' option classes (`vllm_tiercache.shared.config_schema` knows the store).
``make docs`` runs ``tiercache config schema --update-docs docs/configuration.md``;
``tests/config/test_config_schema.py`` fails when the docs differ from what this writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vllm_tiercache.tools.cli import UsageError


def sections() -> list[tuple[str, Any]]:
    """(title, class) of each part of the one dict, in the order of the docs."""
    from vllm_tiercache.eccache.options import ECConnectorOptions
    from vllm_tiercache.kvcache.options import KVConnectorOptions
    from vllm_tiercache.shared.config import StoreConfig

    return [("Store keys", StoreConfig), ("KV connector keys", KVConnectorOptions),
            ("EC connector keys", ECConnectorOptions)]


def whole_schema() -> dict[str, Any]:
    """The JSON schema of the one dict both connectors and the tools read."""
    from vllm_tiercache.eccache.options import ECConnectorOptions
    from vllm_tiercache.kvcache.options import KVConnectorOptions
    from vllm_tiercache.shared.config_schema import config_schema

    return config_schema({"TieredKVConnector": KVConnectorOptions, "TieredECConnector": ECConnectorOptions})


def docs_markdown() -> str:
    """The generated part of docs/configuration.md, markers included."""
    from vllm_tiercache.eccache.options import ManagerOptions
    from vllm_tiercache.shared.config_schema import docs_section
    from vllm_tiercache.shared.store.admission_config import AdmissionConfig
    from vllm_tiercache.shared.store.sealing.config import EncryptionConfig

    return docs_section(whole_schema(), sections(),
                        more=[("`admission` of a slower tier (disk, gds, redis)", AdmissionConfig),
                              ("`encryption` of the store (encryption at rest)", EncryptionConfig),
                              ("`manager_config` of the encoder cache managers", ManagerOptions)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Print the JSON schema of the config dict (the store's keys, the tiers by kind, both "
                          "connectors' options), or the docs tables generated from it.")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--manager-config", action="store_true",
                      help="the schema of the encoder cache managers' manager_config instead")
    what.add_argument("--markdown", action="store_true", help="print the docs tables (markdown) instead")
    what.add_argument("--update-docs", metavar="FILE", default=None,
                      help="rewrite the generated part of FILE (docs/configuration.md), between its "
                           "<!-- BEGIN GENERATED SCHEMA --> and <!-- END GENERATED SCHEMA --> lines")


def run(args: argparse.Namespace) -> int:
    if args.update_docs:
        update_docs(Path(args.update_docs))
    elif args.markdown:
        print(docs_markdown(), end="")
    elif args.manager_config:
        from vllm_tiercache.eccache.options import ManagerOptions
        from vllm_tiercache.shared.config_schema import section_schema

        print(json.dumps(section_schema(ManagerOptions), indent=2))
    else:
        print(json.dumps(whole_schema(), indent=2))
    return 0


def update_docs(path: Path) -> None:
    """Rewrite the generated part of ``path`` (a `UsageError` when it cannot be read or has no markers)."""
    from vllm_tiercache.shared.config_schema import replace_generated

    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"--update-docs: cannot read {str(path)!r} ({exc.strerror or exc}); allowed: a "
                         "readable markdown file") from None
    try:
        new = replace_generated(text, docs_markdown())
    except ValueError as exc:
        raise UsageError(f"--update-docs: {str(path)!r}: {exc}") from None
    if new != text:
        path.write_text(new)
    print(f"{path}: {'updated' if new != text else 'up to date'}")
