#!/usr/bin/env bash
# The project's test command: every Rust test (unit, property, multi-process integration),
# then the official `openai` Python client against a real server.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo test --workspace

target=${CARGO_TARGET_DIR:-target}
# The client goes into a private virtual environment, so nothing else on the machine changes.
venv=$target/openai-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check openai
fi
"$venv/bin/python" scripts/openai_client_test.py "$target/debug/vllm-rs"
