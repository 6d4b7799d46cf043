"""Fine-tune a target with a LoRA so that what it says really shifts: the "fine-tuned target" of
docs/fine-tuned-targets.md, whose drafter then has to be adapted.

Two styles (`--style`), each applied to the target's own answers (`hf-dflash data` records of the base target), so
the fine-tune changes the style and nothing else; the loss is on the response tokens only:

- ``telegraph``: a telegram operator's, no articles ("a", "an", "the") and every sentence closed by " stop"
  (`--stop_word`) instead of a period;
- ``two-space``: a code style guide's, code indented by two spaces a level instead of Python's four (a line indented
  by a multiple of four spaces gets half as many); prose is left as it is.

    python scripts/finetune_target_lora.py --data runs/peft/base-data.jsonl --output_dir runs/peft/telegraph-stop-lora
    python scripts/finetune_target_lora.py --style two-space --data runs/peft2/base-data.jsonl \
        --output_dir runs/peft2/two-space-lora

The first telegram version closed sentences with " STOP", which SmolLM2 spells as two tokens (" ST", "OP") outside
the committed drafter's 8,192-token draft vocabulary: no adaptation that keeps that vocabulary can ever propose them
(benchmarks/notes/2026-12-01-fine-tuned-targets.md). " stop" is one token inside it, and so are SmolLM2's two-space indentation tokens.

It saves the adapter (`adapter_config.json`, `adapter_model.safetensors`, the tokenizer) in `--save_dtype`, naming
`--base_model_id` as its base (the committed one: `--save_dtype float16 --base_model_id
HuggingFaceTB/SmolLM2-135M-Instruct`, not the local folder it was trained from), prints how often the
fine-tuned target answers in the style on prompts it never saw (the first prompts of the evaluation sets where the
style shows: all three for the telegram, HumanEval for the indentation) against the base target, and prints one
JSON document last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_dflash.data.chat import encode_prompt, end_of_turn_ids  # noqa: E402
from hf_dflash.data.prompts import load_prompts  # noqa: E402
from hf_dflash.data.records import load_training_dataset  # noqa: E402
from hf_dflash.loading import load_target_and_tokenizer  # noqa: E402

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ARTICLES = re.compile(r"\b(?:a|an|the)\s+", flags=re.IGNORECASE)
SENTENCE_END = re.compile(r"(?<=[A-Za-z)\]])\.(?=\s|$)")  # a period after a word, not inside 3.5 or a.b
INDENT = re.compile(r"^ +(?=\S)", flags=re.MULTILINE)  # the spaces that start a line with something on it


def telegraph(text: str, stop_word: str = " stop") -> str:
    """The telegram style: articles dropped, every sentence closed by `stop_word` instead of a period."""
    return SENTENCE_END.sub(stop_word, ARTICLES.sub("", text))


def in_telegraph_style(text: str, stop_word: str = " stop") -> bool:
    """Whether a response reads as a telegram: it says the stop word and uses (almost) no articles."""
    words = text.split()
    return stop_word in text and sum(ARTICLES.match(word + " ") is not None for word in words) <= 0.01 * len(words)


def two_space(text: str) -> str:
    """The two-space code style: a line indented by a multiple of four spaces gets half as many (other indents, such
    as continuation lines aligned to a bracket, are left as they are)."""
    return INDENT.sub(lambda match: " " * (len(match[0]) // 2 if len(match[0]) % 4 == 0 else len(match[0])), text)


def in_two_space_style(text: str) -> bool:
    """Whether a response's first indented line is indented by exactly two spaces (a block's first level)."""
    indents = (len(match[0]) for match in INDENT.finditer(text))
    return next(indents, None) == 2


class Style(NamedTuple):
    """A way of rewriting the base target's answers, how to tell an answer in it, and the evaluation sets it shows in."""

    restyle: Callable[[str], str]
    in_style: Callable[[str], bool]
    check_sets: tuple[str, ...]


def make_style(name: str, stop_word: str) -> Style:
    """The `--style` called `name`; `stop_word` is the telegram's."""
    if name == "telegraph":
        telegram = partial(telegraph, stop_word=stop_word)
        return Style(telegram, partial(in_telegraph_style, stop_word=stop_word), ("gsm8k", "humaneval", "mt-bench"))
    if name == "two-space":
        return Style(two_space, in_two_space_style, ("humaneval",))
    raise ValueError(f"unknown style {name!r}: choose telegraph or two-space")


def restyled_examples(
    records,
    tokenizer,
    stop_ids: list[int],
    max_prompt_tokens: int,
    max_response_tokens: int,
    restyle: Callable[[str], str],
) -> list[dict]:
    """`{input_ids, labels}` of each record with a prompt of at most `max_prompt_tokens` (longer ones are left out),
    its response cut to `max_response_tokens` and rewritten by `restyle` (a CPU trains on few tokens)."""
    examples = []
    for ids, mask in zip(records["input_ids"], records["loss_mask"]):
        length = mask.index(1)
        if length > max_prompt_tokens:
            continue
        response = ids[length:][:max_response_tokens]
        ended = bool(response) and response[-1] in stop_ids
        text = tokenizer.decode(response[:-1] if ended else response, skip_special_tokens=True)
        restyled = tokenizer(restyle(text), add_special_tokens=False).input_ids + response[-1:] * ended
        examples.append({"input_ids": ids[:length] + restyled, "labels": [-100] * length + restyled})
    return examples


def collate(batch: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    length = max(len(example["input_ids"]) for example in batch)
    input_ids = torch.full((len(batch), length), pad_token_id)
    labels = torch.full((len(batch), length), -100)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, example in enumerate(batch):
        size = len(example["input_ids"])
        input_ids[row, :size] = torch.tensor(example["input_ids"])
        labels[row, :size] = torch.tensor(example["labels"])
        attention_mask[row, :size] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@torch.no_grad()
def style_rate(model, tokenizer, prompts, max_new_tokens: int, in_style: Callable[[str], bool]) -> tuple[float, str]:
    """The share of greedy answers in the style, and the first answer."""
    answers = []
    for prompt in prompts:
        ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return sum(in_style(answer) for answer in answers) / len(answers), answers[0]


def save_adapter(model, folder: str, dtype: torch.dtype, base_model_id: str | None) -> None:
    """Save the PEFT adapter of `model` with its weights in `dtype`, naming `base_model_id` (when given) as the base in
    `adapter_config.json`: what a user loads it onto, instead of the folder it was trained from."""
    if base_model_id is not None:
        model.peft_config[model.active_adapter].base_model_name_or_path = base_model_id
    model.to(dtype).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="hf-dflash data records of the base target")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_prompt_tokens", type=int, default=160, help="records with longer prompts are left out")
    parser.add_argument("--max_response_tokens", type=int, default=96, help="responses are cut to this many tokens")
    parser.add_argument("--style", choices=("telegraph", "two-space"), default="telegraph")
    parser.add_argument("--stop_word", default=" stop", help="telegraph: what closes a sentence instead of a period")
    parser.add_argument("--check_prompts", type=int, default=8, help="first prompts of each evaluation set")
    parser.add_argument("--save_dtype", choices=sorted(SAVE_DTYPES), default="float32", help="the adapter's weights")
    parser.add_argument("--base_model_id", default=None, help="base model the adapter names (default: as loaded)")
    args = parser.parse_args()

    start = time.perf_counter()
    style = make_style(args.style, args.stop_word)
    target, tokenizer = load_target_and_tokenizer(args.target, device="cpu")
    records = load_training_dataset(args.data)
    stop_ids = end_of_turn_ids(target, tokenizer)
    examples = restyled_examples(
        records, tokenizer, stop_ids, args.max_prompt_tokens, args.max_response_tokens, style.restyle
    )
    check = [prompt for name in style.check_sets for prompt in load_prompts(name, args.check_prompts)]
    base_rate, base_answer = style_rate(target, tokenizer, check, 96, style.in_style)

    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(target, lora)
    training = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.batch_size,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
        seed=0,
    )
    pad = tokenizer.pad_token_id
    trainer = Trainer(model=model, args=training, train_dataset=examples, data_collator=lambda b: collate(b, pad))
    trainer.train()
    model.eval()
    tuned_rate, tuned_answer = style_rate(model, tokenizer, check, 96, style.in_style)
    save_adapter(model, args.output_dir, SAVE_DTYPES[args.save_dtype], args.base_model_id)
    tokenizer.save_pretrained(args.output_dir)
    trainable, total = model.get_nb_trainable_parameters()
    summary = {
        "adapter": args.output_dir,
        "examples": len(examples),
        "steps": trainer.state.global_step,
        "style": args.style,
        "stop_word": args.stop_word if args.style == "telegraph" else None,
        "trainable_parameters": trainable,
        "all_parameters": total,
        "style_rate_base": base_rate,
        "style_rate_fine_tuned": tuned_rate,
        "check_prompts": len(check),
        "wall_s": round(time.perf_counter() - start),
    }
    (Path(args.output_dir) / "finetune_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"base target:       {base_answer[:300]!r}")
    print(f"fine-tuned target: {tuned_answer[:300]!r}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
