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

# The CUDA sources compile with NVRTC for sm_90a (Hopper) in every dtype and sm_90 in
# bf16, and every kernel the launch wrappers look up is in the CUBIN: no GPU needed, only
# libnvrtc, taken from NVIDIA's PyPI wheel into the same private environment.
if ! "$venv/bin/python" -c "import nvidia.cu13" >/dev/null 2>&1; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc==13.0.*"
fi
nvrtc_lib=$("$venv/bin/python" -c "import nvidia.cu13, os; print(os.path.join(nvidia.cu13.__path__[0], 'lib'))")
VLLM_REQUIRE_NVRTC=1 LD_LIBRARY_PATH="$nvrtc_lib" CUDA_HOME=/nonexistent cargo test -p vllm-kernels --test cuda_nvrtc -- --ignored
