"""Serving engines that run DFlash drafters on a CPU, driven through their own programs: `llama_cpp` (export to
GGUF, run, measure). Built outside the repository by `scripts/install_engines.sh`."""
