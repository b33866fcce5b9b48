"""SFT on branching conversations: the format, its rendering (masks, shared prefixes), and the loss falling."""

from __future__ import annotations

import json

import pytest
import torch

from treerl.errors import DataError
from treerl.rollout import load_tokenizer
from treerl.trainer import SFT_DEFAULTS, ConfigError, sft
from treerl.trainer.sft.data import SFTData, chat_format, example_path, load_conversations, paths
from treerl.tree import PrefixTree


def _m(role, content, **kw):
    return {"role": role, "content": content, **kw}


def test_every_root_to_leaf_path_of_nested_branches():
    tree = [_m("user", "q"), _m("assistant", "a"),
            {"branches": [[_m("assistant", "b")], [_m("tool", "t"), {"branches": [[_m("assistant", "c")],
                                                                                [_m("assistant", "d")]]}]]}]
    got = [[m["content"] for m in path] for path in paths(tree, "x")]
    assert got == [["q", "a", "b"], ["q", "a", "t", "c"], ["q", "a", "t", "d"]]


@pytest.mark.parametrize("bad, message", [
    ([{"branches": [[_m("assistant", "a")]]}, _m("user", "late")], r"x\[0\]: 'branches' must be the last item"),
    ([_m("robot", "hi")], r"x\[0\]: a message needs 'role'"),
    ([_m("assistant", "a", train="yes")], r"x\[0\]: 'train' must be true or false"),
    ([{"branches": []}], r"x\[0\]: 'branches' must be a non-empty list"),
    ([_m("user", "q"), {"branches": [[]]}], r"x\[1\].branches\[0\]: expected a non-empty list"),
])
def test_bad_conversations_name_the_place(bad, message):
    with pytest.raises(ValueError, match=message):
        paths(bad, "x")


@pytest.fixture(scope="module")
def chat():
    return chat_format(load_tokenizer(None), "template")


def _write(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rendering_trains_exactly_the_assistant_replies_and_shares_prefixes(chat, tmp_path):
    row = {"id": "c", "messages": [
        _m("system", "sys"), _m("user", "hi"), _m("assistant", "<call>f(1)</call>"), _m("tool", "2"),
        {"branches": [[_m("assistant", "two")], [_m("assistant", "skip", train=False), _m("user", "?"),
                                                  _m("assistant", "2")]]}]}
    (conversation,) = load_conversations(_write(tmp_path, [row]), chat)
    first, second = conversation.sequences
    tok = chat.tokenizer

    def trained(seq):
        ids, mask = seq.tokens.tolist(), seq.fields["loss_mask"].tolist()
        return "".join(tok.decode([t]) if m else "|" for t, m in zip(ids, mask)).split("|")

    assert [t for t in trained(first) if t] == ["<call>f(1)</call><eos>", "two<eos>"]
    assert [t for t in trained(second) if t] == ["<call>f(1)</call><eos>", "2<eos>"]  # "skip" is context only
    assert tok.decode(second.tokens.tolist()) == (
        "<bos><system>sys<eos><user>hi<eos><assistant><call>f(1)</call><eos><tool>2<eos>"
        "<assistant>skip<eos><user>?<eos><assistant>2<eos>")
    shared = len(tok("<bos><system>sys<eos><user>hi<eos><assistant><call>f(1)</call><eos><tool>2<eos><assistant>")
                 ["input_ids"])
    assert torch.equal(first.tokens[:shared], second.tokens[:shared])
    assert first.info == {"group": "c", "trajectory": "c/0"} and second.name == "c/path1"


def test_plain_format_and_file_errors(tmp_path):
    plain = chat_format(load_tokenizer(None), "plain")
    (conversation,) = load_conversations(_write(tmp_path, [{"messages": [_m("user", "hi"), _m("assistant", "yo")]}]),
                                         plain)
    assert plain.tokenizer.decode(conversation.sequences[0].tokens.tolist()) == "User: hi\nAssistant: yo<eos>"
    assert conversation.id == "row0"
    with pytest.raises(ValueError, match=r"data.jsonl:1 path 0: a path without an assistant message"):
        load_conversations(_write(tmp_path, [{"messages": [_m("user", "hi")]}]), plain)
    with pytest.raises(ValueError, match=r"data.jsonl:1: expected an object with 'messages'"):
        load_conversations(_write(tmp_path, [{"turns": []}]), plain)
    with pytest.raises(DataError, match="sft.data_path"):
        load_conversations(tmp_path / "missing.jsonl", plain)


def test_the_shipped_example_is_a_forest_of_agent_trajectories(chat):
    conversations = load_conversations(example_path(), chat)
    sequences = [s for c in conversations for s in c.sequences]
    assert len(conversations) >= 15 and len(sequences) > 2 * len(conversations)
    assert PrefixTree.build(sequences).stats().compression > 2
    text = example_path().read_text()
    assert '"role": "tool"' in text and "<call>" in text and '"train": false' in text
    data = SFTData(conversations, per_step=4, seed=0)
    assert [s.name for s in data.batch(3)] == [s.name for s in data.batch(3)]  # a function of the step
    epoch = [s.info["group"] for step in range(len(conversations) // 2) for s in SFTData(conversations, 2).batch(step)]
    assert set(epoch) == {c.id for c in conversations}  # one epoch visits every conversation


def test_sft_on_the_shipped_example_lowers_the_loss(tiny_config, tmp_path):
    config = tiny_config("trainer.steps=6", "trainer.lr=3e-3", "sft.conversations_per_step=3",
                         "sft.eval_conversations=4", config="sft_example", base=SFT_DEFAULTS)
    result = sft(config)
    assert result.loss_end < 0.85 * result.loss_start
    assert result.train_loss_last < result.train_loss_first
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/nll" in r] == list(range(6))
    assert all(r["batch/compression"] > 1 for r in rows if "batch/compression" in r)


def test_sft_needs_the_sft_loss(tiny_config):
    with pytest.raises(ConfigError, match="algo.loss=sft"):
        sft(tiny_config("algo.loss=grpo", config="sft_example", base=SFT_DEFAULTS))


def test_sft_on_conversations_that_show_images(tiny_config, tmp_path):
    """A branching agent conversation with a screenshot in its question and another in a tool result: each path shows
    its screenshots at their places (the second after the reply and the template's glue), the branches share the
    first, the pixels are not held between reads (rendered again, the same sequence), a bad image fails at load naming
    the row, and `treerl sft` trains a vision-language shape on it (the vision tower too)."""
    import numpy as np
    from PIL import Image

    from treerl.models import model_config
    from treerl.rollout.conversations.images import ImageProcessor
    from treerl.rollout.conversations.tokenizer import builtin_tokenizer

    for seed in (0, 1):
        pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / f"shot{seed}.png")

    def shows(text, seed):
        return [{"type": "image", "image": str(tmp_path / f"shot{seed}.png")}, {"type": "text", "text": text}]

    row = {"id": "gui", "messages": [
        _m("user", shows("Open it.", 0)), _m("assistant", "<click 3>"), _m("tool", shows("Opened.", 1)),
        {"branches": [[_m("assistant", "done")], [_m("assistant", "<click 5>")]]}]}
    data = _write(tmp_path, [row, {"messages": [_m("user", "hi"), _m("assistant", "yo")]}])
    tokenizer = builtin_tokenizer(vision=True)
    chat = chat_format(tokenizer, "template", ImageProcessor(model_config("tiny-qwen2.5-vl", len(tokenizer))))
    conversation, text_only = load_conversations(data, chat)
    first, second = conversation.sequences
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert [(i.start, i.length) for i in first.images] == [(3, 16), (42, 16)]
    between = tokenizer.decode(first.tokens[first.images[0].end : first.images[1].start].tolist())
    assert between == "<vision_end>Open it.<eos><assistant><click 3><eos><tool><vision_start>"
    for sequence in (first, second):
        assert all(sequence.tokens[i.start : i.end].eq(image_id).all() for i in sequence.images)
        assert sequence.fields["loss_mask"][[i.start for i in sequence.images]].sum() == 0
    assert [i.digest for i in first.images] == [i.digest for i in second.images]
    again = conversation.sequences[0]
    assert again is not first and torch.equal(again.tokens, first.tokens)
    assert [i.digest for i in again.images] == [i.digest for i in conversation.counted[0].images]
    assert all(i.pixel_values.numel() == 0 for s in conversation.counted for i in s.images)  # stand-ins only
    assert text_only.sequences is text_only.counted  # text: rendered once, kept
    stats = PrefixTree.build(conversation.counted).stats()
    assert stats.unique_tokens < stats.flat_tokens - 2 * 16  # both screenshots held once by the two branches
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [_m("user", shows("?", 7)), _m("assistant", "a")]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1 path 0, image 0: image file .*shot7.png' does not exist"):
        load_conversations(bad, chat)
    config = tiny_config("trainer.steps=2", "model.shape=tiny-qwen2.5-vl", f"sft.data_path={data}",
                         "sft.conversations_per_step=2", "sft.eval_conversations=1", config="sft_example",
                         base=SFT_DEFAULTS)
    result = sft(config)
    assert result.steps == 2 and np.isfinite(result.loss_end)
