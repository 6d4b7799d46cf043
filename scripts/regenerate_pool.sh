#!/usr/bin/env bash
# Regenerate a prompt pool's responses with a packaged target (TARGET, default smollm2-135m-instruct) served by
# llama.cpp's llama-server, in fp32.
#
# The HF target is the package's quantized GGUF dequantized to fp32; this converts that checkpoint to an F32 GGUF, so
# the server runs the target's own weights without llama.cpp's 4-bit kernels (SmolLM2: 42 of 48 greedy ShareGPT
# responses token-identical to in-process ones, against 7 of 48 from the Q4_1 file; Gemma-3-270m: 16 of 16 held-out
# pool prompts), and serves it with SLOTS parallel sequences. `hf-dflash data` appends to OUTPUT and skips ids it
# holds, so rerunning this script resumes after any interruption.
#
#   bash scripts/install_engines.sh            # llama.cpp's tools, once
#   python scripts/prompt_pool.py ... --output ../data/pool.jsonl
#   bash scripts/regenerate_pool.sh ../data/pool.jsonl ../data/records.jsonl [NUM_PROMPTS] [SLOTS]
#   TARGET=gemma3-270m bash scripts/regenerate_pool.sh ...   # another packaged target (hf_dflash.targets)
set -euo pipefail
POOL=${1:?prompt pool .jsonl}
OUTPUT=${2:?output records .jsonl}
NUM_PROMPTS=${3:-100000}
SLOTS=${4:-16}
PORT=${PORT:-8093}
TARGET=${TARGET:-smollm2-135m-instruct}
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1
ENGINES=${HF_DFLASH_ENGINES:-$HOME/.cache/hf_dflash/engines}
LLAMA_CPP=$ENGINES/llama-cpp-python-0.3.36/vendor/llama.cpp
TARGET_DIR=$(python -c "from hf_dflash.targets import converted_target_folder; print(converted_target_folder('$TARGET'))")
GGUF=$ENGINES/$TARGET-f32.gguf
if [ ! -f "$GGUF" ]; then
  PYTHONPATH=$LLAMA_CPP/gguf-py python "$LLAMA_CPP/convert_hf_to_gguf.py" "$TARGET_DIR" --outtype f32 \
    --outfile "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
fi
"$LLAMA_CPP/build/bin/llama-server" -m "$GGUF" -np "$SLOTS" -c $((SLOTS * 1280)) -t 2 --port "$PORT" --no-webui \
  > "$OUTPUT.server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
hf-dflash data --target "$TARGET" --source "$POOL" --num_prompts "$NUM_PROMPTS" --max_new_tokens 192 \
  --max_prompt_tokens 1024 --server_url "http://127.0.0.1:$PORT" --concurrency "$SLOTS" --output "$OUTPUT"
