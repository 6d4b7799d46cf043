"""The target's chat template: every rendering of it and every probe of its layout, written once.

A prompt reaches the target as its chat template renders it, ending with the assistant header. Three facts about
the template are read by rendering a chat that holds ``_SENTINEL`` (a string no template or prompt contains) and
looking at the text around it:

- ``user_header``: the text before a user message's content (what ``synthesize_prompts`` feeds the target);
- ``user_turn_closer``: the special token right after a user message's content (``<|im_end|>``, ``<|eot_id|>``,
  ``<end_of_turn>``), which is one of the ``end_of_turn_ids``;
- ``assistant_turn_closer``: the special token right after an assistant message's content (``</s>`` for
  Mistral, whose user turns close with ``[/INST]``), which a server's stopped answer gets appended.

A tokenizer without a chat template (a base model) gets the messages' raw text, joined by blank lines, with its
usual special tokens around it; a rendered template already holds its special tokens, so none are added to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_dflash.data.prompts import Prompt
from hf_dflash.model.generation_dflash import token_ids

_SENTINEL = "\u2063HF_DFLASH_SENTINEL\u2063"  # a string no chat template or prompt contains


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer has a chat template (a base model's tokenizer has none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict]) -> str:
    """Chat messages as model input text, ending with the assistant header (``add_generation_prompt``).

    Tokenizers without a chat template (base models) get the messages' raw text, joined by blank lines.
    """
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return "\n\n".join(message["content"] for message in messages)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """A prompt rendered as model input text, ending with the assistant header (see ``render_messages``)."""
    return render_messages(tokenizer, prompt.messages)


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict]) -> list[int]:
    """Token ids of chat messages in the chat template, ending with the assistant header.

    The rendered template already holds its special tokens (BOS included), so none are added; a tokenizer
    without a chat template gets its usual special tokens around the raw text.
    """
    text = render_messages(tokenizer, messages)
    return tokenizer(text, add_special_tokens=not has_chat_template(tokenizer)).input_ids


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids of a prompt in the chat template, ending with the assistant header (see ``encode_messages``)."""
    return encode_messages(tokenizer, prompt.messages)


def user_header(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template's text up to where a user message's content starts (system prompt included).

    Raises ``ValueError`` when the tokenizer has no chat template.
    """
    if not has_chat_template(tokenizer):
        raise ValueError("The tokenizer has no chat template, so there is no user header to write a user turn after.")
    text = _render_with_sentinel(tokenizer, [{"role": "user", "content": _SENTINEL}])
    return text[: text.index(_SENTINEL)]


def user_turn_closer(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token right after a user message's content in the chat template, if there is one."""
    if not has_chat_template(tokenizer):
        return None
    return _special_token_after_sentinel(tokenizer, [{"role": "user", "content": _SENTINEL}])


def assistant_turn_closer(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token right after an assistant message's content in the chat template, if there is one.

    ``None`` also when the template refuses a chat of one user and one assistant message (jinja
    ``raise_exception``), so that callers fall back to EOS.
    """
    if not has_chat_template(tokenizer):
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        return _special_token_after_sentinel(tokenizer, messages)
    except Exception:  # templates may refuse such a chat (jinja raise_exception)
        return None


def end_of_turn_ids(target: PreTrainedModel | GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end a turn, sorted: the target's EOS ids (from the model or its ``GenerationConfig``), the
    tokenizer's EOS, and the special token that closes a user turn in the chat template (``user_turn_closer``)."""
    generation_config = target if isinstance(target, GenerationConfig) else target.generation_config
    ids = [*token_ids(generation_config.eos_token_id), tokenizer.eos_token_id, user_turn_closer(tokenizer)]
    return sorted({i for i in ids if i is not None})


def _render_with_sentinel(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    """``messages`` (one of them holding ``_SENTINEL``) rendered without the assistant header."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def _special_token_after_sentinel(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> int | None:
    """The first token after ``_SENTINEL`` in the rendered chat, when it is a special token; else ``None``."""
    text = _render_with_sentinel(tokenizer, messages)
    if _SENTINEL not in text:
        return None
    suffix = tokenizer(text[text.index(_SENTINEL) + len(_SENTINEL) :], add_special_tokens=False).input_ids
    return suffix[0] if suffix and suffix[0] in tokenizer.all_special_ids else None
