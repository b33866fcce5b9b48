"""Tokenizers: a checkpoint's own, or a built-in character-level one that needs no download.

Step 1 (docs/architecture.md): text to token ids and back.

The built-in tokenizer is a real `transformers.PreTrainedTokenizerFast` (a `tokenizers` WordLevel
model over single characters), so the rollout code runs the same calls on it as on
`AutoTokenizer.from_pretrained(checkpoint)`: `apply_chat_template`, `decode`, `eos_token_id`,
`save_pretrained`. Its chat template renders a conversation as

    <bos><system>...<eos><user>...<eos><assistant>...<eos><tool>...<eos><assistant>

one role marker token per message and `<eos>` closing each turn; the model ends its reply with `<eos>`.
With `tools`, a first `<system>` turn lists each tool's function as JSON, one per line, and an
assistant message's `tool_calls` follow its content Hermes-style, written in characters:
`<tool_call>{"name": "lookup", "arguments": {"id": 3}}</tool_call>` (parsed back by
`treerl.rollout.agents.tool_parsers`' "hermes" parser).
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from treerl.errors import ModelPathError

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>") + tuple(f"<{role}>" for role in ROLES)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
# A vision-language shape's image, video and vision start/end ids are the top four of its vocabulary
# (treerl.models.model_config): with `vision=True` these four close the built-in vocabulary, highest last.
VISION_TOKENS = ("<vision_end>", "<vision_start>", "<video>", "<image>")

BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<system>' }}{% for tool in tools %}"
    "{{ (tool['function'] if tool['function'] is defined else tool) | tojson + '\n' }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for message in messages %}{{ '<' + message['role'] + '>' }}"
    "{% if message['content'] is string or not message['content'] %}{{ message['content'] or '' }}"
    "{% else %}{% for part in message['content'] %}"
    "{{ part['text'] if part['type'] == 'text' else '<vision_start><image><vision_end>' }}{% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": ' + f['name'] | tojson + ', \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}{{ '}</tool_call>' }}{% endfor %}"
    "{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)

# For checkpoints without a chat template (base models): plain "User: ...\nAssistant: " turns.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ message['role'] | capitalize }}{{ ': ' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)


def plain_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The plain "User: ...\nAssistant: " format, after the BOS token where the tokenizer puts one before any text: a
    chat template renders without the tokenizer's special tokens, and a base model trained with a BOS first (Gemma)
    writes "222222" to "3+4=" without it."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a").input_ids
    return "{{ bos_token }}" + PLAIN_CHAT_TEMPLATE if bos is not None and ids[:1] == [bos] else PLAIN_CHAT_TEMPLATE


def builtin_tokenizer(vision: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer for the built-in tasks: digits, letters, punctuation, space, newline (and with
    `vision`, the four image tokens of a vision-language shape)."""
    roles = [f"<{role}>" for role in ROLES]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS) + (VISION_TOKENS if vision else ()))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()  # join characters back without separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        # The vision tokens by the names a processor reads (`tokenizer.image_token`: Qwen-VL's processor in vLLM)
        extra_special_tokens={t.strip("<>") + "_token": t for t in VISION_TOKENS} if vision else roles,
    )
    if vision:
        tokenizer.add_tokens(roles, special_tokens=True)  # in the vocabulary already: special, ids unchanged
    tokenizer.chat_template = BUILTIN_CHAT_TEMPLATE
    return tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(path: str | Path | None = None, trust_remote_code: bool = False,
                   vision: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of the local checkpoint at `path` (never downloaded), or the built-in one when `path` is None
    (with the image tokens of a vision-language shape when `vision`)."""
    if path is None:
        return builtin_tokenizer(vision)
    if not Path(path).exists():
        raise ModelPathError(f"tokenizer path {str(path)!r} does not exist (treerl never downloads tokenizers)")
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ModelPathError(f"tokenizer path {str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])} "
                             "...): not a transformers checkpoint directory? (model.tokenizer_path can name another)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelPathError(f"tokenizer path {str(path)!r}: cannot load it ({type(e).__name__}: {text})") from None
    if tokenizer.chat_template is None:
        tokenizer.chat_template = plain_template(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
