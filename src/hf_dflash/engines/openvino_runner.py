"""OpenVINO GenAI's `LLMPipeline` on an `hf_dflash.engines.openvino` export, run INSIDE the OpenVINO venv.

    <openvino-venv>/bin/python -I openvino_runner.py < request.json > report.json

(`-I` keeps this folder off `sys.path`: its `openvino.py` would shadow the `openvino` package.)

Not imported by hf-dflash (the venv has its own transformers; this file needs only the standard library, numpy and
openvino_genai, which that venv holds). The request is one JSON document:

    {"ir": "<folder with target/ and draft/>", "prompts": [[token ids...] | "chat-rendered text", ...],
     "max_new_tokens": 128, "with_draft": true, "block_size": 8, "device": "CPU", "threads": 2,
     "properties": {"KV_CACHE_PRECISION": "f32", ...}, "paged": false}

`properties` go to the target and the draft alike (OpenVINO device properties; values as strings). `paged` runs the
plain target through GenAI's continuous-batching pipeline (paged attention, the path the drafter's verification
takes) instead of the default stateful one. Greedy decoding, one prompt at a time; texts are not templated again.

The last line on stdout is the report: per prompt the new token ids and text, `target_steps` (target forwards, the
prompt's included: the length of the pipeline's per-step token counts), `accepted_tokens` (draft tokens the target
kept: GenAI's `get_num_accepted_tokens()`, which counts every step after the first; `get_num_draft_tokens()` is not
reported for DFlash), and tokens/s; plus the device's effective precisions.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    request = json.load(sys.stdin)
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    device = request.get("device", "CPU")
    properties = dict(request.get("properties") or {})
    if request.get("threads"):
        properties["INFERENCE_NUM_THREADS"] = int(request["threads"])
    ir = request["ir"].rstrip("/")
    scheduler = genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False  # DFlash refuses prefix caching (GenAI's default)
    if request["with_draft"]:
        draft = genai.draft_model(f"{ir}/draft", device, **properties)
        pipe = genai.LLMPipeline(f"{ir}/target", device, draft_model=draft, scheduler_config=scheduler, **properties)
    elif request.get("paged"):
        pipe = genai.LLMPipeline(f"{ir}/target", device, scheduler_config=scheduler, **properties)
    else:
        pipe = genai.LLMPipeline(f"{ir}/target", device, **properties)
    config = pipe.get_generation_config()
    config.max_new_tokens = int(request["max_new_tokens"])
    config.do_sample = False
    config.apply_chat_template = False  # prompts come rendered (or as ids)
    if request["with_draft"]:
        config.num_assistant_tokens = int(request["block_size"]) - 1
    tokenizer = pipe.get_tokenizer()

    runs = []
    for prompt in request["prompts"]:
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=False).input_ids.data[0].tolist()
        else:
            ids = [int(token) for token in prompt]
        inputs = ov.Tensor(np.array([ids], dtype=np.int64))
        result = pipe.generate(inputs, config)
        new_ids = [int(token) for token in result.tokens[0]]
        metrics = result.perf_metrics
        steps = len(metrics.raw_metrics.m_batch_sizes)
        extended = getattr(result, "extended_perf_metrics", None)
        accepted = extended.get_num_accepted_tokens() if request["with_draft"] and extended is not None else 0
        runs.append(
            {
                "prompt_tokens": len(ids),
                "token_ids": new_ids,
                "text": tokenizer.decode(new_ids, skip_special_tokens=False),
                "new_tokens": len(new_ids),
                "target_steps": steps,
                "step_tokens": [int(size) for size in metrics.raw_metrics.m_batch_sizes],
                "accepted_tokens": int(accepted),
                "tokens_per_s": float(metrics.get_throughput().mean),
            }
        )
        sys.stderr.write(f"openvino_runner: prompt {len(runs)}/{len(request['prompts'])} done\n")  # progress
    core = ov.Core()
    effective = {
        name: str(core.get_property(device, name))
        for name in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION")
    }
    report = {
        "openvino_genai": genai.__version__,
        "device": device,
        "properties": properties,
        "device_defaults": effective,
        "runs": runs,
    }
    sys.stdout.write(json.dumps(report) + "\n")  # the protocol with hf_dflash.engines.openvino, not a log


if __name__ == "__main__":
    main()
