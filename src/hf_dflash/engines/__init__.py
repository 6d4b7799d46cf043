"""Serving engines that run DFlash drafters on a CPU, driven through their own programs: `llama_cpp` (export to
GGUF, run, measure) and `openvino` (export to OpenVINO IR, run GenAI's pipeline in the engine's own venv). Built
outside the repository by `scripts/install_engines.sh [--openvino]`."""

ENGINES = ("llama.cpp", "openvino", "vllm", "sglang")  # what `export.export_for_engine` writes a drafter for
