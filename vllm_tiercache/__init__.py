"""vllm-tiercache: tiered KV-cache and encoder-cache connectors for vLLM.

One import namespace over the repository's folders (see `[tool.setuptools.package-dir]` in
pyproject.toml): `vllm_tiercache.shared` (store, records, keys, eviction), `vllm_tiercache.kvcache` and
`vllm_tiercache.eccache` (the connectors, on `shared`), `vllm_tiercache.tools` (CLI, jobs, benchmarks,
demo, on both). `vllm_tiercache.plugin` is vLLM's entry point.
"""

from pathlib import Path

# In a source checkout the subpackages are folders beside this one (the wheel maps them under
# `vllm_tiercache` through pyproject's package-dir). Searching the checkout's root too makes a checkout
# import its own code, installed or not: a second clone, or a process started with PYTHONPATH=<checkout>,
# never runs the subpackages of another checkout's editable install.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "shared" / "__init__.py").is_file():
    __path__.append(str(_checkout))
