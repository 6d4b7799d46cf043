#!/usr/bin/env bash
# Build the CPU engines hf-dflash's drafters are checked against, from pinned PyPI sources, cached between runs.
#
#   bash scripts/install_engines.sh            # llama.cpp tools (about 6 min on 2 cores the first time, then cached)
#
# llama.cpp comes vendored in the llama-cpp-python sdist; only the tools the checks use are built:
# llama-speculative-simple (DFlash decoding), llama-simple (plain greedy text), llama-bench (plain speed) and
# llama-server (an OpenAI-compatible server, for `hf-dflash data --server_url`). Its converter (convert_hf_to_gguf.py) runs with the vendored gguf-py, which knows
# the DFlash architectures. Where it lands: $HF_DFLASH_ENGINES (default ~/.cache/hf_dflash/engines); the last line
# printed is that folder, which `hf_dflash.engines` finds by the same rule.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
ENGINES="${HF_DFLASH_ENGINES:-$HOME/.cache/hf_dflash/engines}"
SOURCE="$ENGINES/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_CPP="$SOURCE/vendor/llama.cpp"
BUILD="$LLAMA_CPP/build"
TOOLS=(llama-speculative-simple llama-simple llama-bench llama-server)
PYTHON="${PYTHON:-python}"

mkdir -p "$ENGINES"
if [ ! -f "$LLAMA_CPP/CMakeLists.txt" ]; then
    download="$(mktemp -d "$ENGINES/download.XXXXXX")"
    trap 'rm -rf "$download"' EXIT
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$download"
    tar -xzf "$download"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz -C "$download"
    rm -rf "$SOURCE"
    mv "$download/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" "$SOURCE"  # whole or not at all
fi

missing=()
for tool in "${TOOLS[@]}"; do
    [ -x "$BUILD/bin/$tool" ] || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    cmake -S "$LLAMA_CPP" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_CURL=OFF -DGGML_NATIVE=ON >/dev/null
    cmake --build "$BUILD" -j "$(nproc)" --target "${missing[@]}" >/dev/null
fi
for tool in "${TOOLS[@]}"; do
    [ -x "$BUILD/bin/$tool" ] || { echo "install_engines.sh: $tool was not built in $BUILD/bin" >&2; exit 1; }
done
echo "$ENGINES"
