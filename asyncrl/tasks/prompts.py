"""Prompt rendering: how an ``Example`` becomes the token ids a model is given.

Every consumer renders through one ``PromptRenderer``: the generators' prompt stream
(``asyncrl.tasks.stream.TaskPrompts``), the buffer's reward-model scorer, SFT data, evaluation
and preference data. So the tokens the trainer scores are the tokens the engine was
given, and SFT teaches the layout RL and evaluation prompt with.

``TaskConfig.prompt_format`` picks the rendering. "plain" tokenizes the templated prompt
text with the special tokens the tokenizer's post-processor adds (Llama's BOS; nothing for
Qwen or the tiny char tokenizer). "chat" runs the tokenizer's chat template over the
system prompt and the user turn (or the row's own ``messages``) with the generation
prompt, so BOS and turn markers are what the model family expects. A completion (an SFT
target, a preference pair's side) is the assistant turn the template writes for it, up to
and including its end-of-turn token: the token the engine stops at.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.tasks.base import Example, TaskConfig

_SENTINEL = "\x00asyncrl-assistant\x00"
"""Stands for an assistant turn's content where the template's text around it is read."""


class PromptRenderer:
    """Token ids of prompts and completions for one tokenizer and prompt format."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_format: str = "plain",
        system_prompt: str | None = None,
    ) -> None:
        if prompt_format not in ("plain", "chat"):
            raise ValueError(f'task.prompt_format {prompt_format!r} is not "plain" or "chat"')
        if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"task.prompt_format=chat, and the tokenizer of {tokenizer.name_or_path!r} "
                f"has no chat template: add one to its tokenizer_config.json or use "
                f"task.prompt_format=plain"
            )
        self.tokenizer = tokenizer
        self.chat = prompt_format == "chat"
        self.system_prompt = system_prompt
        # The token a completion ends with: what the engine stops at (the model's EOS, an
        # instruct tokenizer's end of turn).
        self.end_id = tokenizer.eos_token_id
        # Where a templated assistant turn ends: its first special token. A base model's
        # EOS (Qwen's <|endoftext|>) need not be the template's end of turn (<|im_end|>).
        self._turn_ends = ({self.end_id} | set(tokenizer.all_special_ids)) - {
            tokenizer.bos_token_id
        }

    @classmethod
    def for_task(cls, cfg: TaskConfig, tokenizer: PreTrainedTokenizerBase) -> PromptRenderer:
        return cls(tokenizer, cfg.prompt_format, cfg.system_prompt)

    def messages(self, example: Example) -> list[dict[str, str]]:
        """The chat turns before the completion: the system prompt (unless the row brings
        its own), then the row's conversation or its prompt as the user turn."""
        turns = list(example.messages or [{"role": "user", "content": example.prompt}])
        if self.system_prompt is not None and not any(t["role"] == "system" for t in turns):
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return turns

    def prompt_ids(self, example: Example) -> list[int]:
        """The prompt's token ids, ready for the engine (ending where generation starts)."""
        if not self.chat:
            return self.tokenizer(example.prompt, add_special_tokens=True)["input_ids"]
        return self._template(self.messages(example), add_generation_prompt=True)

    def completion_ids(self, example: Example, completion: str) -> list[int]:
        """``completion`` as the answer to ``example``: its tokens through the end token.

        Chat: the tokens the template adds after the prompt for the assistant turn, cut
        after its first special token, the end of turn (a template may write a newline
        after it, which the engine never samples). Where the template's rendering of the whole conversation
        does not start with the prompt's tokens (a tokenizer merging across the boundary),
        the completion is tokenized alone, as the engine would continue the prompt."""
        if self.chat:
            prompt = self.prompt_ids(example)
            turns = [*self.messages(example), {"role": "assistant", "content": completion}]
            full = self._template(turns, add_generation_prompt=False)
            if full[: len(prompt)] == prompt:
                rest = full[len(prompt) :]
                ends = [i for i, token in enumerate(rest) if token in self._turn_ends]
                if ends:
                    return rest[: ends[0] + 1]
        ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
        return ids + [self.end_id]

    def observation_ids(self, messages: list[dict[str, str]], turn_end: int | None) -> list[int]:
        """The token ids that follow a model turn, for an environment's ``messages``: with a
        chat template, what the template writes after an assistant turn's content that the
        model did not sample (Qwen's newline after ``<|im_end|>``, or the whole end of turn
        when the model was cut short), then the messages and the generation prompt; plain,
        the messages' contents tokenized as they are. ``turn_end`` is the model turn's last
        token. Only these new tokens are tokenized: the model's turn is never re-tokenized."""
        if not self.chat:
            text = "".join(m["content"] for m in messages)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        # What the template writes after an assistant turn's content, read where that turn
        # is not the last (a template may render the last one differently, as Qwen3's
        # does with its thinking block): only this text is new.
        history = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
        after = self.tokenizer.apply_chat_template(
            history + messages, add_generation_prompt=True, tokenize=False
        )
        text = after[after.index(_SENTINEL) + len(_SENTINEL) :]
        if turn_end is not None and turn_end in self._turn_ends:
            sampled = self.tokenizer.decode([turn_end])  # the end of turn the model wrote
            text = text[len(sampled) :] if text.startswith(sampled) else text
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _template(self, turns: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            turns, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        return list(ids)
