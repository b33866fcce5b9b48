"""Multi-turn contexts grow token by token and still equal the chat template's rendering."""

from __future__ import annotations

import pytest

from treerl.rollout import ChatFormat
from treerl.rollout.conversations.tokenizer import PLAIN_CHAT_TEMPLATE, builtin_tokenizer


def _conversation_by_continuation(chat: ChatFormat, turns: list[tuple[str, str]]) -> list[int]:
    """Build a context the way the multi-turn workflow does: prompt, then reply + continuation per turn."""
    context = chat.prompt([{"role": "user", "content": "guess"}])
    for reply, tool in turns:
        reply_ids = chat.tokenizer(reply, add_special_tokens=False)["input_ids"] + [chat.stop_token_ids[0]]
        context += reply_ids + chat.continuation([{"role": "tool", "content": tool}])
    return context


# Qwen's ChatML layout: the model's stop token <|im_end|> is followed by a newline it does not generate.
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer(template: str):
    tokenizer = builtin_tokenizer()
    if template == "plain":
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    if template == "chatml":
        tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("template", ["builtin", "plain", "chatml"])
def test_incremental_context_equals_full_rendering(template):
    chat = ChatFormat(_tokenizer(template))
    turns = [("5", "higher"), ("7", "lower"), ("6", "correct")]
    messages = [{"role": "user", "content": "guess"}]
    for reply, tool in turns:
        messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": tool}]
    assert _conversation_by_continuation(chat, turns) == chat.prompt(messages)


def test_plain_template_glue_after_the_stop_token():
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    chat = ChatFormat(tokenizer)
    assert tokenizer.decode(chat.continuation([{"role": "tool", "content": "ok"}])) == "\nTool: ok\nAssistant: "


def test_a_cut_off_reply_gets_a_stop_token_inserted(chat):
    stopped = chat.continuation([{"role": "tool", "content": "x"}], reply_stopped=True)
    cut = chat.continuation([{"role": "tool", "content": "x"}], reply_stopped=False)
    assert cut == [chat.tokenizer.eos_token_id] + stopped


def test_extra_stop_tokens_and_bad_ones(tokenizer):
    chat = ChatFormat(tokenizer, stop_tokens=["<tool>"])
    assert chat.stop_token_ids == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<tool>")]
    with pytest.raises(ValueError, match="not a single token"):
        ChatFormat(tokenizer, stop_tokens=["<nope>"])


def test_template_that_does_not_end_turns_with_a_stop_token_is_refused():
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not close an assistant turn"):
        ChatFormat(tokenizer)
