#!/usr/bin/env bash
# Build the CPU engines hf-dflash's drafters are checked against, from pinned PyPI sources, cached between runs.
#
#   bash scripts/install_engines.sh              # llama.cpp tools (about 6 min on 2 cores the first time, then cached)
#   bash scripts/install_engines.sh --openvino   # OpenVINO GenAI + optimum-intel in their own venv (~2 min, 1.6 GB)
#
# llama.cpp comes vendored in the llama-cpp-python sdist; only the tools the checks use are built:
# llama-speculative-simple (DFlash decoding), llama-simple (plain greedy text), llama-bench (plain speed) and
# llama-server (an OpenAI-compatible server, for `hf-dflash data --server_url`). Its converter (convert_hf_to_gguf.py) runs with the vendored gguf-py, which knows
# the DFlash architectures. Where it lands: $HF_DFLASH_ENGINES (default ~/.cache/hf_dflash/engines); the last line
# printed is that folder (with --openvino: its openvino-venv), which `hf_dflash.engines` finds by the same rule.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
ENGINES="${HF_DFLASH_ENGINES:-$HOME/.cache/hf_dflash/engines}"
PYTHON="${PYTHON:-python}"
mkdir -p "$ENGINES"

# --openvino: optimum-intel 2.2.0 (the IR export) pins transformers<5.6 and huggingface-hub<1.22, which clash with
# hf-dflash's, so it gets its own venv that `hf_dflash.engines.openvino` drives by subprocess. torchvision is removed
# (its PyPI wheel fails against torch+cpu: "operator torchvision::nms does not exist"); einops and diffusers 0.37 are
# imports transformers checks when the draft loads through optimum's remote-code path (newer diffusers want a newer
# hub). torch only traces the export: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu gets its small CPU
# build instead of PyPI's CUDA one. The venv's marker file holds the pins it was built with: same pins, nothing to do.
if [ "${1:-}" = "--openvino" ]; then
    OPENVINO_PINS=(torch==2.13.0 "transformers<5.6" "huggingface-hub<1.22" optimum-intel==2.2.0
        openvino-genai==2026.4.1.0 einops diffusers==0.37.0)
    VENV="$ENGINES/openvino-venv"
    MARKER="$VENV/hf-dflash-pins.txt"
    if [ "$(cat "$MARKER" 2>/dev/null)" != "${OPENVINO_PINS[*]}" ]; then
        rm -rf "$VENV"
        "$PYTHON" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q "${OPENVINO_PINS[@]}"
        "$VENV/bin/python" -m pip uninstall -q -y torchvision 2>/dev/null || true
        if ! check="$("$VENV/bin/python" -c "import openvino_genai, optimum.intel.openvino" 2>&1)"; then
            echo "install_engines.sh: the OpenVINO venv in $VENV does not import:" >&2; echo "$check" >&2; exit 1
        fi
        echo "${OPENVINO_PINS[*]}" >"$MARKER"  # written last: a half-built venv has no marker and is rebuilt
    fi
    echo "$VENV"
    exit 0
fi
SOURCE="$ENGINES/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_CPP="$SOURCE/vendor/llama.cpp"
BUILD="$LLAMA_CPP/build"
TOOLS=(llama-speculative-simple llama-simple llama-bench llama-server)

if [ ! -f "$LLAMA_CPP/CMakeLists.txt" ]; then
    download="$(mktemp -d "$ENGINES/download.XXXXXX")"
    trap 'rm -rf "$download"' EXIT
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$download"
    tar -xzf "$download"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz -C "$download"
    rm -rf "$SOURCE"
    mv "$download/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" "$SOURCE"  # whole or not at all
fi

# Native code but no AMX: on an Intel Xeon VM whose CPU lists AMX (Firecracker kernel), ggml's AMX kernels for
# quantized weights die with SIGILL on the first batch of a few tokens (tileloadd, though a one-shot AMX program runs
# there), so any Q4 GGUF fails; GCC lets these -mno-* win over -march=native's. A build made with other flags (the
# marker file holds them) is rebuilt.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_CURL=OFF
    -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
MARKER="$BUILD/hf-dflash-cmake-flags.txt"
if [ -d "$BUILD" ] && [ "$(cat "$MARKER" 2>/dev/null)" != "${CMAKE_FLAGS[*]}" ]; then
    rm -rf "$BUILD"
fi
missing=()
for tool in "${TOOLS[@]}"; do
    [ -x "$BUILD/bin/$tool" ] || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    cmake -S "$LLAMA_CPP" -B "$BUILD" "${CMAKE_FLAGS[@]}" >/dev/null
    cmake --build "$BUILD" -j "$(nproc)" --target "${missing[@]}" >/dev/null
    echo "${CMAKE_FLAGS[*]}" >"$MARKER"
fi
for tool in "${TOOLS[@]}"; do
    [ -x "$BUILD/bin/$tool" ] || { echo "install_engines.sh: $tool was not built in $BUILD/bin" >&2; exit 1; }
done
echo "$ENGINES"
