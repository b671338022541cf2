#!/usr/bin/env bash
# Installs the project, editable, with one extra and the dev tools, into a venv: `make setup` calls it.
# Usage: scripts/install_deps.sh VENV_PYTHON EXTRA
#
# Why uv first: on a 2-core machine pip took 80-130 s of every fresh clone's `make test` (resolving and
# unpacking ~150 packages one by one); uv installs the same set in about 10 s. uv does not read pip's
# configuration, so the settings this machine gives pip (constraints, find-links, index URLs, its CA
# bundle) are handed to uv as flags. Any failure on the uv path (uv not installable, a setting it does not
# take) falls back to pip, which reads its configuration itself. TIERCACHE_INSTALLER=pip skips uv.
#
# Why --compile-bytecode: uv, unlike pip, writes no .pyc files by default, and where PYTHONDONTWRITEBYTECODE
# is set (this machine kind sets it) Python never writes them either, so every process would compile torch,
# vLLM and transformers from source at each import. Measured here: a fresh one-process engine took 48.7
# CPU-s without .pyc files and 22.6 with them. The suite starts well over a hundred such interpreters (every
# vLLM EngineCore is spawned fresh); compiling once at install costs about 100 CPU-s.
set -u
PY=$1
EXTRA=$2
SPEC=".[$EXTRA,dev]"

uv_flags() {
  # pip's effective settings (files and PIP_* variables) as uv flags, one per line.
  "$PY" - <<'EOF'
import shlex, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"constraint": "--constraint", "find-links": "--find-links", "index-url": "--index-url",
         "extra-index-url": "--extra-index-url"}
seen = set()
for line in out.splitlines():
    name, _, value = line.partition("=")
    key = name.rsplit(".", 1)[-1]
    for item in shlex.split(value):
        if key in flags and (key, item) not in seen:
            seen.add((key, item))
            print(flags[key]); print(item)
        elif key == "cert":
            print(f"cert={item}")
EOF
}

install_with_uv() {
  [ "${TIERCACHE_INSTALLER:-uv}" = "uv" ] || return 1
  "$PY" -m pip install -q uv >/dev/null 2>&1 || return 1
  local uv args=() line
  uv="$(dirname "$PY")/uv"
  [ -x "$uv" ] || return 1
  while IFS= read -r line; do
    case "$line" in
      cert=*) export SSL_CERT_FILE="${line#cert=}" ;;
      *) args+=("$line") ;;
    esac
  done < <(uv_flags)
  echo "tiercache setup: installing with uv ($("$uv" --version))"
  # pip picks the best version across every index it is given; uv, by default, the first index that has the
  # package: --index-strategy unsafe-best-match is pip's rule
  "$uv" pip install -q --python "$PY" --index-strategy unsafe-best-match --compile-bytecode "${args[@]}" -e "$SPEC"
}

if ! install_with_uv; then
  echo "tiercache setup: installing with pip"
  "$PY" -m pip install -q --upgrade pip && "$PY" -m pip install -q -e "$SPEC" || exit 1
fi
