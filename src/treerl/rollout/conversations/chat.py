"""Conversations as token ids: the prompt of a first turn, and what follows a model reply in a later turn.

Step 1 (docs/architecture.md): the token ids of prompts and replies.

A multi-turn episode is built token by token, never by re-rendering the whole conversation: the
context of turn i+1 is exactly the context of turn i, plus the reply the model sampled, plus the
tokens of the environment's answer. That is what makes the sequences of one episode extend each
other (so the prefix tree shares them) and keeps the trained tokens identical to the sampled ones.
The tokens of the environment's answer come from the chat template itself, as the difference of
two renderings of a fixed conversation (the same trick as verl's multi-turn rollout).
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from treerl.errors import UserError
from treerl.rollout.conversations.images import IMAGE_PARTS, ImageProcessor, expand_images, image_parts, read_images
from treerl.tree import ImageSpan

Message = dict[str, Any]  # {"role", "content"} (+ "tool_calls" on an assistant turn, "tool_call_id" on a tool turn)
Tool = dict[str, Any]  # an OpenAI tool definition: {"type": "function", "function": {"name", "description", "parameters"}}

# A fixed conversation ending in an assistant reply, to read off how the template continues after one.
_BASE = [{"role": "user", "content": "0"}, {"role": "assistant", "content": "0"}]
NOT_EXTENSIBLE = ("the chat template renders an assistant turn differently once messages follow it, so a multi-turn "
                  "context cannot be extended token by token; use a template without that behaviour")


# A tool offered to see whether the chat template writes tools into the prompt at all (SmolLM2's does not).
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


def template_shows_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template writes offered tools into the prompt at all (the model can only call what it sees)."""
    render = lambda tools: tokenizer.apply_chat_template(_BASE, tools=tools, tokenize=False)
    return render([_PROBE_TOOL]) != render(None)


class ChatFormat:
    """Renders messages with the tokenizer's chat template and knows which tokens end a reply; with `images` (a
    vision-language model's processor) it renders image content parts too (`prompt_with_images`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_tokens: list[str] | tuple[str, ...] = (),
                 images: ImageProcessor | None = None):
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; load it with treerl.rollout.load_tokenizer")
        if tokenizer.eos_token_id is None:
            raise UserError("the tokenizer has no eos token: cannot tell where a reply ends (model.tokenizer_path)")
        self.tokenizer = tokenizer
        self.images = images
        extra = []
        for token in stop_tokens:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == tokenizer.unk_token_id:
                raise UserError(f"rollout.stop_tokens: {token!r} is not a single token of the tokenizer")
            extra.append(token_id)
        self.stop_token_ids: list[int] = list(dict.fromkeys([tokenizer.eos_token_id, *extra]))
        self._base = self.render(_BASE, add_generation_prompt=False)
        self._glue = self._end_of_turn_glue()
        self.shows_tools = template_shows_tools(tokenizer)


    def render(self, messages: list[Message], add_generation_prompt: bool, tools: list[Tool] | None = None) -> list[int]:
        """Token ids of a conversation (with the tools offered, if any), as the model's chat template writes it."""
        messages = [_without_pixels(m) for m in messages]  # the template writes an image token, never the pixels
        return list(
            self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False,
            )
        )

    def render_text(self, messages: list[Message], add_generation_prompt: bool, tools: list[Tool] | None = None
                    ) -> str:
        """`render`'s conversation as text, before tokenizing (where a processor expands images in the text)."""
        return self.tokenizer.apply_chat_template([_without_pixels(m) for m in messages], tools=tools or None,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False)

    def prompt(self, messages: list[Message], tools: list[Tool] | None = None) -> list[int]:
        """The first turn's context: the conversation so far and the assistant's generation prompt (of a text
        conversation: `prompt_with_images` renders images too)."""
        if image_parts(messages):
            raise UserError("a conversation that shows images is rendered with ChatFormat.prompt_with_images, which "
                            "gives the images' places too")
        return self.render(messages, add_generation_prompt=True, tools=tools)

    def prompt_with_images(self, messages: list[Message], tools: list[Tool] | None = None, who: str = "a prompt"
                           ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The first turn's context and the images it shows: each image part's token expanded into its placeholder
        tokens, the image read and processed as the model's processor does (`treerl.rollout.conversations.images`)."""
        if self.images is not None and self.images.expands_text:
            text = self.render_text(messages, add_generation_prompt=True, tools=tools)
            return self.images.tokenize_with_images(text, read_images(messages, who), self.tokenizer, who)
        ids = self.render(messages, add_generation_prompt=True, tools=tools)
        return expand_images(ids, read_images(messages, who), self.images, who)

    def continuation(
        self, messages: list[Message], reply_stopped: bool = True, tools: list[Tool] | None = None
    ) -> list[int]:
        """Tokens to append after a model reply: end of its turn, `messages` (tool results), next generation prompt.

        A reply cut off at `max_new_tokens` has no stop token; one is inserted (not trained on) so the
        conversation stays well formed.
        """
        if image_parts(messages):
            raise UserError("messages that show images are rendered with ChatFormat.continuation_with_images, which "
                            "gives the images' places too")
        return self.continuation_with_images(messages, reply_stopped, tools)[0]

    def continuation_with_images(self, messages: list[Message], reply_stopped: bool = True,
                                 tools: list[Tool] | None = None, offset: int = 0, who: str = "a request"
                                 ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """`continuation`, and the images its messages show (an agent's screenshot), placed as if the continuation
        started at token `offset` (the length of the context it extends)."""
        head = ([] if reply_stopped else [self.stop_token_ids[0]]) + self._glue
        if self.images is not None and self.images.expands_text and image_parts(messages):  # Gemma 3: in the text
            before_text = self.render_text(_BASE, add_generation_prompt=False, tools=tools)
            after_text = self.render_text(_BASE + list(messages), add_generation_prompt=True, tools=tools)
            if not after_text.startswith(before_text):
                raise ValueError(NOT_EXTENSIBLE)
            tail, images = self.images.tokenize_with_images(after_text[len(before_text) :], read_images(messages, who),
                                                            self.tokenizer, who, offset + len(head))
            return head + tail, images
        before = self.render(_BASE, add_generation_prompt=False, tools=tools) if tools else self._base
        after = self.render(_BASE + list(messages), add_generation_prompt=True, tools=tools)
        if after[: len(before)] != before:
            raise ValueError(NOT_EXTENSIBLE)
        tail, images = expand_images(after[len(before) :], read_images(messages, who), self.images, who,
                                     offset + len(head))
        return head + tail, images

    def _end_of_turn_glue(self) -> list[int]:
        """Tokens the template writes after an assistant's stop token (e.g. Qwen's newline after <|im_end|>)."""
        rendered = self._base
        stops = [i for i, token in enumerate(rendered) if token in self.stop_token_ids]
        if not stops:
            raise ValueError(
                "the chat template does not close an assistant turn with a stop token "
                f"({self.tokenizer.convert_ids_to_tokens(self.stop_token_ids)}); "
                "pass the token that does as a stop token"
            )
        return rendered[stops[-1] + 1 :]

    def reply_text(self, token_ids: list[int]) -> str:
        """What a reward function or environment reads: the reply without its final stop token.

        Special tokens are kept, so a reply padded with role markers or <pad> is not mistaken
        for a clean answer.
        """
        if token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


def _without_pixels(message: Message) -> Message:
    """The message as the chat template reads it: each image part as a bare `{"type": "image"}`."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [{"type": "image"} if isinstance(p, dict) and p.get("type") in IMAGE_PARTS else p for p in content]
    return {**message, "content": parts}
