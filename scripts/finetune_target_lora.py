"""Fine-tune a target with a LoRA so that what it says really shifts: the "fine-tuned target" of README "Fine-tuned
targets", whose drafter then has to be adapted.

The style is a telegram operator's: no articles ("a", "an", "the") and every sentence closed by " stop" (`--stop_word`)
instead of a period. The training responses are the target's own answers (`hf-dflash data` records of the base target)
rewritten in that style, so the fine-tune changes the style and nothing else; the loss is on the response tokens only.

    python scripts/finetune_target_lora.py --data runs/peft/base-data.jsonl --output_dir runs/peft/telegraph-stop-lora

The first version closed sentences with " STOP", which SmolLM2 spells as two tokens (" ST", "OP") outside the committed
drafter's 8,192-token draft vocabulary: no adaptation that keeps that vocabulary can ever propose them (README
"Fine-tuned targets"). " stop" is one token inside it.

It saves the adapter (`adapter_config.json`, `adapter_model.safetensors`, the tokenizer) in `--save_dtype`, naming
`--base_model_id` as its base (the committed one: `--save_dtype float16 --base_model_id
HuggingFaceTB/SmolLM2-135M-Instruct`, not the local folder it was trained from), prints how often the
fine-tuned target answers in the style on prompts it never saw (the evaluation sets' first prompts) against the base
target, and prints one JSON document last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_dflash.data import encode_prompt, end_of_turn_ids, load_training_dataset  # noqa: E402
from hf_dflash.loading import load_target_and_tokenizer  # noqa: E402
from hf_dflash.prompts import load_prompts  # noqa: E402

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ARTICLES = re.compile(r"\b(?:a|an|the)\s+", flags=re.IGNORECASE)
SENTENCE_END = re.compile(r"(?<=[A-Za-z)\]])\.(?=\s|$)")  # a period after a word, not inside 3.5 or a.b


def telegraph(text: str, stop_word: str = " stop") -> str:
    """The telegram style: articles dropped, every sentence closed by `stop_word` instead of a period."""
    return SENTENCE_END.sub(stop_word, ARTICLES.sub("", text))


def in_style(text: str, stop_word: str = " stop") -> bool:
    """Whether a response reads as a telegram: it says the stop word and uses (almost) no articles."""
    words = text.split()
    return stop_word in text and sum(ARTICLES.match(word + " ") is not None for word in words) <= 0.01 * len(words)


def restyled_examples(
    records, tokenizer, stop_ids: list[int], max_prompt_tokens: int, max_response_tokens: int, stop_word: str
) -> list[dict]:
    """`{input_ids, labels}` of each record with a prompt of at most `max_prompt_tokens` (longer ones are left out),
    its response cut to `max_response_tokens` and rewritten in the telegram style (a CPU trains on few tokens)."""
    examples = []
    for ids, mask in zip(records["input_ids"], records["loss_mask"]):
        length = mask.index(1)
        if length > max_prompt_tokens:
            continue
        response = ids[length:][:max_response_tokens]
        ended = bool(response) and response[-1] in stop_ids
        text = tokenizer.decode(response[:-1] if ended else response, skip_special_tokens=True)
        restyled = tokenizer(telegraph(text, stop_word), add_special_tokens=False).input_ids + response[-1:] * ended
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
def style_rate(model, tokenizer, prompts, max_new_tokens: int, stop_word: str) -> tuple[float, str]:
    """The share of greedy answers in the telegram style, and the first answer."""
    answers = []
    for prompt in prompts:
        ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return sum(in_style(answer, stop_word) for answer in answers) / len(answers), answers[0]


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
    parser.add_argument("--stop_word", default=" stop", help="what closes a sentence instead of a period")
    parser.add_argument("--check_prompts", type=int, default=8, help="first prompts of each evaluation set")
    parser.add_argument("--save_dtype", choices=sorted(SAVE_DTYPES), default="float32", help="the adapter's weights")
    parser.add_argument("--base_model_id", default=None, help="base model the adapter names (default: as loaded)")
    args = parser.parse_args()

    start = time.perf_counter()
    target, tokenizer = load_target_and_tokenizer(args.target, device="cpu")
    records = load_training_dataset(args.data)
    stop_ids = end_of_turn_ids(target, tokenizer)
    examples = restyled_examples(
        records, tokenizer, stop_ids, args.max_prompt_tokens, args.max_response_tokens, args.stop_word
    )
    check = [
        prompt for name in ("gsm8k", "humaneval", "mt-bench") for prompt in load_prompts(name, args.check_prompts)
    ]
    base_rate, base_answer = style_rate(target, tokenizer, check, 96, args.stop_word)

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
    tuned_rate, tuned_answer = style_rate(model, tokenizer, check, 96, args.stop_word)
    save_adapter(model, args.output_dir, SAVE_DTYPES[args.save_dtype], args.base_model_id)
    tokenizer.save_pretrained(args.output_dir)
    trainable, total = model.get_nb_trainable_parameters()
    summary = {
        "adapter": args.output_dir,
        "examples": len(examples),
        "steps": trainer.state.global_step,
        "stop_word": args.stop_word,
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
