#!/usr/bin/env bash
# Installs what building and testing meshnet needs on a fresh Debian machine with a Rust
# toolchain: rustfmt and clippy, cargo-fuzz for the fuzz targets, the default model file
# (scripts/fetch-model.sh) for the model tests, a compose tool for the Docker testnet when a
# Docker engine is installed, and a Python virtualenv with the `openai` package for the OpenAI
# client checks. Idempotent.
#
#   MESHNET_VENV=DIR   the virtualenv (default .venv in the repository root)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install a Rust toolchain (https://rustup.rs) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi
bash "$repo/scripts/fetch-model.sh" >/dev/null

# The Docker testnet (testnet/docker.sh) needs a compose tool beside the engine, and strip
# (binutils) to slim the packaged binary.
apt_install() {
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    echo "installing $*"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "note: install $* for the Docker testnet (apt-get install $*)" >&2
  fi
}
if command -v docker >/dev/null 2>&1; then
  if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
    apt_install docker-compose
  fi
  command -v strip >/dev/null 2>&1 || apt_install binutils
fi

# The virtualenv for scripts/openai_client_check.py.
venv=${MESHNET_VENV:-$repo/.venv}
if ! "$venv/bin/python" -c 'import openai' >/dev/null 2>&1; then
  # Debian's python3 without the python3-venv package has the venv module but no ensurepip.
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -m ensurepip --version >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
      apt_install python3-venv
    else
      echo "python3 cannot create virtualenvs: install python3-venv (apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
  echo "installing the openai package into $venv"
  # Creating over an existing venv keeps it and (re)installs pip into it.
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check openai
fi
echo "setup done"
