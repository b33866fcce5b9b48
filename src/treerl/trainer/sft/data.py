"""Branching conversations for SFT: the JSONL format, and its rendering into token sequences.

Step 2 (docs/architecture.md) for SFT: conversations as token sequences.

One JSON object per line, a conversation:

    {"id": "weather-1",                                   # optional; default "row<N>" (0-based)
     "messages": [
       {"role": "system", "content": "You can call tools ..."},
       {"role": "user", "content": "Weather in Paris?"},
       {"role": "assistant", "content": "<call>weather(Paris)</call>"},
       {"role": "tool", "content": "18C, sun"},
       {"branches": [                                     # alternative continuations: each a list of messages
         [{"role": "assistant", "content": "18C and sunny."}],
         [{"role": "assistant", "content": "<call>forecast(Paris)</call>"},
          {"role": "tool", "content": "rain tomorrow"},
          {"role": "assistant", "content": "18C now, rain tomorrow.", "train": true}]
       ]}
     ]}

A user or tool message may show images: its content a list of parts, `{"type": "text", "text": ...}` and
`{"type": "image", "image": "shots/1.png"}` (a local path, a base64 data URL, or OpenAI's `image_url` part), for a
vision-language model (treerl.rollout.conversations.images). A conversation that shows images is rendered again each time a step
reads it: its pixels are not held between steps (a dataset of screenshots would not fit in memory), only its token
counts are.

A `{"branches": [...]}` item ends its list; a branch may end in branches of its own, so a
conversation is a tree. Every root-to-leaf path is one training sequence, trained on its
assistant messages (their text and the stop token that ends them; `"train": false` leaves an
assistant message as untrained context). Paths share their common beginning token for token, so
the tree engine computes it once; its gradient counts once per path, exactly as if each path
were a separate example.

Rendering follows the rollout (treerl.rollout.conversations.chat): the messages before the first assistant
reply are rendered with the chat template and its generation prompt; an assistant reply is its
tokens plus the stop token, as the model would generate it; what follows a reply (tool results,
user turns, the next generation prompt) is the template's own continuation. So SFT sequences look
exactly like the model's sampled ones.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from treerl.errors import DataError, UserError
from treerl.rollout.conversations.chat import ChatFormat, Message
from treerl.rollout.conversations.images import ImageProcessor, image_parts
from treerl.rollout.conversations.tokenizer import plain_template
from treerl.rollout.tasks.base import rng_for
from treerl.rollout.tasks.dataset import is_content, located_rows
from treerl.tree import TokenSequence
from treerl.tree.io import MAX_LINE_BYTES

ROLES = ("system", "user", "assistant", "tool")


def example_path() -> Path:
    """The shipped example: branching agent trajectories with tool calls (treerl/data/sft_example.jsonl)."""
    return Path(str(resources.files("treerl") / "data" / "sft_example.jsonl"))


def chat_format(tokenizer: PreTrainedTokenizerBase, kind: str, images: ImageProcessor | None = None) -> ChatFormat:
    """`template`: the tokenizer's chat template (load_tokenizer gives template-less ones the plain format);
    `plain`: "Role: content" lines whatever the tokenizer has. `images`: the model's image processor, if it takes
    images."""
    if kind == "plain":
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = plain_template(tokenizer)
    return ChatFormat(tokenizer, images=images)


def paths(items: list[Any], where: str) -> list[list[dict[str, Any]]]:
    """Every root-to-leaf list of messages of a (possibly branching) message list, checked."""
    if not isinstance(items, list) or not items:
        raise DataError(f"{where}: expected a non-empty list of messages")
    prefix: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        here = f"{where}[{k}]"
        if not isinstance(item, dict):
            raise DataError(f"{here}: expected a message object, got {type(item).__name__}")
        if "branches" in item:
            if k != len(items) - 1:
                raise DataError(f"{here}: 'branches' must be the last item of its list (put what follows in each branch)")
            branches = item["branches"]
            if not isinstance(branches, list) or not branches:
                raise DataError(f"{here}: 'branches' must be a non-empty list of message lists")
            return [prefix + rest for b, branch in enumerate(branches) for rest in paths(branch, f"{here}.branches[{b}]")]
        if item.get("role") not in ROLES or not is_content(item.get("content")):
            raise DataError(f"{here}: a message needs 'role' (one of {', '.join(ROLES)}) and a 'content': a string, "
                            "or a list of text and image parts")
        if item["role"] == "assistant" and not isinstance(item["content"], str):
            raise DataError(f"{here}: an assistant reply is trained as text: its 'content' must be a string")
        if not isinstance(item.get("train", True), bool):
            raise DataError(f"{here}: 'train' must be true or false")
        check_no_tool_calls(item, here)
        prefix.append(item)
    return [prefix]


def check_no_tool_calls(message: dict[str, Any], where: str) -> None:
    """A reply is trained as the text of its 'content': structured 'tool_calls' (of any type) would be left out."""
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        raise DataError(f"{where}: 'tool_calls' is not read by SFT (got {type(calls).__name__}): a reply is trained "
                        "as the text of its 'content', so write each call there as the model writes it (e.g. "
                        "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)")


def render_path(chat: ChatFormat, messages: list[dict[str, Any]], where: str) -> TokenSequence:
    """One path as a sequence: its tokens, loss mask (1 on trained assistant replies and their stop token) and the
    images it shows."""
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise DataError(f"{where}: a path without an assistant message has nothing to train")
    first = replies[0]
    try:
        return _render(chat, messages, first, replies[-1], where)
    except UserError as e:  # an image that cannot be read, or a model that takes none
        raise DataError(str(e)) from None


def _render(chat: ChatFormat, messages: list[dict[str, Any]], first: int, last: int, where: str) -> TokenSequence:
    """`render_path` from the first assistant reply (`first`) to the last (`last`)."""
    tokens, images = chat.prompt_with_images([_plain(m) for m in messages[:first]], who=where)
    mask = [0.0] * len(tokens)
    pending: list[Message] = []
    for k in range(first, last + 1):
        message = messages[k]
        if message["role"] != "assistant":
            pending.append(_plain(message))
            continue
        if k != first:
            glue, shown = chat.continuation_with_images(pending, offset=len(tokens), who=where)
            tokens += glue
            images += shown
            mask += [0.0] * len(glue)
            pending = []
        reply = chat.tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [chat.stop_token_ids[0]]
        tokens += reply
        mask += [1.0 if message.get("train", True) else 0.0] * len(reply)
    return TokenSequence(tokens, {"loss_mask": torch.tensor(mask)}, images=images)


def _plain(message: dict[str, Any]) -> Message:
    return {"role": message["role"], "content": message["content"]}


@dataclass
class Conversation:
    """One conversation's paths as training sequences (group = the conversation, trajectory = the path).

    `counted`: the sequences without their images' pixels (each image a stand-in that merges as it does), for counting
    tokens and sharing; `sequences` renders them whole: kept when the conversation shows no image, rendered again at
    each read when it does."""

    id: str
    counted: list[TokenSequence]
    paths: list[list[dict[str, Any]]] = field(default_factory=list)
    chat: ChatFormat | None = None  # renders a conversation that shows images
    where: str = ""

    @property
    def sequences(self) -> list[TokenSequence]:
        if not any(s.images for s in self.counted):
            return self.counted
        return [self._sequence(p, path) for p, path in enumerate(self.paths)]

    def _sequence(self, p: int, path: list[dict[str, Any]]) -> TokenSequence:
        sequence = render_path(self.chat, path, f"{self.where} path {p}")
        sequence.info, sequence.name = {"group": self.id, "trajectory": f"{self.id}/{p}"}, f"{self.id}/path{p}"
        return sequence


def load_conversations(path: str | Path, chat: ChatFormat, max_line_bytes: int = MAX_LINE_BYTES) -> list[Conversation]:
    """Read and render every conversation up front, so a bad row fails before training starts.

    The rows come from a JSONL file (or any local format `treerl.rollout.tasks.dataset.located_rows` reads).
    """
    if not Path(path).exists():
        raise DataError(f"sft.data_path={str(path)!r} does not exist")
    conversations = []
    for i, (where, row) in enumerate(located_rows(path, max_line_bytes, "sft.max_line_bytes")):
        if "messages" not in row:
            raise DataError(f"{where}: expected an object with 'messages'")
        cid = str(row.get("id") or f"row{i}")
        conversation = Conversation(cid, [], paths(row["messages"], f"{where} messages"), chat, where)
        for p, path in enumerate(conversation.paths):  # every path rendered now: a bad row fails before training
            sequence = conversation._sequence(p, path)
            sequence.images = tuple(image.stand_in() for image in sequence.images)  # the pixels are not kept
            conversation.counted.append(sequence)
        if not image_parts([m for path in conversation.paths for m in path]):
            conversation.paths, conversation.chat = [], None  # rendered for good
        conversations.append(conversation)
    if not conversations:
        raise DataError(f"{path}: no conversations")
    return conversations


@dataclass
class SFTData:
    """Conversations in a seeded shuffled order, epoch after epoch; a step's batch depends only on the step."""

    conversations: list[Conversation]
    per_step: int
    seed: int = 0
    shuffle: bool = True

    def batch(self, step: int) -> list[TokenSequence]:
        """The sequences (all paths) of conversations step*per_step ... step*per_step + per_step - 1 of the stream."""
        out = []
        for i in range(step * self.per_step, (step + 1) * self.per_step):
            epoch, position = divmod(i, len(self.conversations))
            out.extend(self.conversations[self._order(epoch)[position]].sequences)
        return out

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.conversations)))
        if self.shuffle:
            rng_for("sft", self.seed, epoch).shuffle(order)
        return order
