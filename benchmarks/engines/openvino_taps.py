"""Which target hidden states OpenVINO GenAI hands a DFlash drafter, for a Llama target without layer metadata.

    <openvino-venv>/bin/python benchmarks/engines/openvino_taps.py --ir OUT/target \
        --model ~/.cache/hf_dflash/targets/smollm2-135m-instruct --layers 1 8 14 20 27

Runs INSIDE the OpenVINO venv (`bash scripts/install_engines.sh --openvino`: it has openvino, torch and a
transformers that loads the target). GenAI 2026.4 (`dflash_model_transforms.cpp` -> `eagle3_model_transforms.cpp`
`find_decoder_layer_hidden_state_outputs`) takes, for each tapped layer id, the first node in topological order whose
name contains `layers.{id}/` and that is an `Add` whose second input is a `MatMul` fed by a `Multiply` (the MLP's
residual add, `residual + down_proj(act(gate) * up)`). This script applies that rule to the exported IR, adds those
nodes as outputs, runs the prompt once and compares them with transformers' `hidden_states[id + 1]` (the layer's
output, what hf-dflash trains on) and `hidden_states[id]` (its input). The last line is the report as JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import openvino as ov
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def genai_tap_nodes(model: ov.Model, layer_ids: list[int]) -> list:
    """The nodes GenAI's Eagle3/DFlash fallback picks, in `layer_ids` order (None where none matched)."""

    def residual(node) -> bool:
        if node.get_type_name() != "Add":
            return False
        matmul = node.input_value(1).get_node()
        return matmul.get_type_name() == "MatMul" and matmul.input_value(0).get_node().get_type_name() == "Multiply"

    found: dict[int, object] = {}
    for node in model.get_ordered_ops():
        if not residual(node):
            continue
        for layer in layer_ids:
            if layer not in found and f"layers.{layer}/" in node.get_friendly_name():
                found[layer] = node
                break
    return [found.get(layer) for layer in layer_ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ir", required=True, help="the target's IR folder (export_openvino's OUT/target)")
    parser.add_argument("--model", required=True, help="the target's transformers folder")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 14, 20, 27])
    parser.add_argument("--prompt", default="Janet's ducks lay 16 eggs per day. How many does she sell?")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(args.prompt).input_ids
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [L + 1] x [1, n, H]

    core = ov.Core()
    model = core.read_model(f"{args.ir}/openvino_model.xml")
    nodes = genai_tap_nodes(model, args.layers)
    untapped = [layer for layer, node in zip(args.layers, nodes) if node is None]
    if untapped:
        raise SystemExit(f"GenAI's rule finds no hidden-state node for layers {untapped}")
    model.add_outputs([node.output(0) for node in nodes])
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"})
    request = compiled.create_infer_request()
    n = len(ids)
    inputs = {
        "input_ids": np.array([ids], dtype=np.int64),
        "attention_mask": np.ones((1, n), dtype=np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
        "beam_idx": np.zeros(1, dtype=np.int32),
    }
    request.infer(inputs)
    outputs = compiled.outputs[-len(nodes) :]
    layers = {}
    for layer, node, port in zip(args.layers, nodes, outputs):
        tapped = request.get_tensor(port).data
        layers[layer] = {
            "node": node.get_friendly_name(),
            "max_abs_diff_to_layer_output": float(np.abs(tapped - hidden[layer + 1].numpy()).max()),
            "max_abs_diff_to_layer_input": float(np.abs(tapped - hidden[layer].numpy()).max()),
            "scale": float(np.abs(hidden[layer + 1].numpy()).max()),
        }
        print(layer, layers[layer], flush=True)  # noqa: T201 (a command-line program)
    print(json.dumps({"prompt_tokens": n, "layers": layers}))  # noqa: T201


if __name__ == "__main__":
    main()
