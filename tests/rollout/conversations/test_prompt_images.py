"""Prompts that show images: read from every form a user's data or an agent's request keeps them in, turned into the
pixels and placeholder tokens the model's processor makes, sampled and trained as sampled (the built-in shapes task,
a dataset's image column)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from support import float64_throughout, fresh_model

from treerl.engine import DfsEngine, PolicyHead
from treerl.engine.images import check_images
from treerl.errors import DataError, UserError
from treerl.models import model_config
from treerl.rollout import EmbeddedSampler, Rollout, RolloutConfig, builtin_tokenizer
from treerl.rollout.conversations.chat import ChatFormat
from treerl.rollout.conversations.images import ImageProcessor, image_processor, load_image
from treerl.rollout.sampling.sampler import SamplingParams
from treerl.rollout.tasks import DatasetTask, Shapes
from treerl.tree import PrefixTree

SHAPE = "tiny-qwen2.5-vl"


def _picture(seed: int = 0, size: int = 32) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


def _vision_chat() -> ChatFormat:
    tokenizer = builtin_tokenizer(vision=True)
    return ChatFormat(tokenizer, images=ImageProcessor(model_config(SHAPE, vocab_size=len(tokenizer))))


def test_an_image_reads_the_same_from_every_form_it_comes_in(tmp_path):
    picture = _picture()
    (tmp_path / "a.png").write_bytes(_png(picture))
    data_url = _data_url(picture)
    forms = [picture, np.asarray(picture), _png(picture), {"bytes": _png(picture), "path": None},
             str(tmp_path / "a.png"), data_url]
    for form in forms:
        assert np.array_equal(np.asarray(load_image(form, "row 3")), np.asarray(picture)), type(form)


@pytest.mark.parametrize("value, says", [
    ("https://example.com/cat.png", "downloads nothing"), ("/no/such/image.png", "does not exist"),
    (b"not an image", "cannot read the image"), ("data:image/png,abc", "must be base64"), (3.5, "not float"),
])
def test_an_image_that_cannot_be_read_is_refused_naming_where_it_is(value, says):
    with pytest.raises(UserError, match=f"row 3: .*{says}"):
        load_image(value, "row 3")


def claimed_size_png(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims `width` x `height` pixels (its checksum fixed): a few bytes that would decode
    into gigabytes."""
    import struct
    import zlib

    data = bytearray(_png(_picture(0, size=1)))
    header = b"IHDR" + struct.pack(">II", width, height) + bytes(data[24:29])
    data[12:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(header))
    return bytes(data)


@pytest.mark.parametrize("image, limit, says", [
    (lambda tmp: str(tmp), None, r"image path '.*' is a directory, not an image file"),
    (lambda tmp: Image.new("RGB", (400, 1)), None, r"the image is 400x1 pixels, an aspect ratio above 200"),
    (lambda tmp: claimed_size_png(20000, 20000), None, r"the image is larger than \d+ pixels, the most treerl decodes"),
    (lambda tmp: claimed_size_png(10000, 10000), None, r"the image is larger than \d+ pixels, the most treerl decodes"),
    (lambda tmp: Image.new("RGB", (20, 20)), 100, r"the image is 20x20 pixels, more than the 100 treerl decodes"),
])
def test_an_image_no_processor_could_take_is_refused_when_read(tmp_path, monkeypatch, image, limit, says):
    """Checked from the header, before the pixels are decoded: PIL itself refuses twice its limit with an exception
    of its own, and only warns below that; an image given decoded is held to the same limit (`limit` lowers it);
    Qwen-VL's processor refuses an aspect ratio above 200 mid-rollout."""
    if limit is not None:
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    with pytest.raises(UserError, match=f"^row 3: {says}"):
        load_image(image(tmp_path), "row 3")


def test_each_image_token_the_template_writes_becomes_the_images_placeholders():
    """Two images in one message: each `<image>` the chat template writes expands into the image's placeholder tokens
    (a 32 x 32 image: 8 x 8 patches, merged 2 x 2: 16 tokens; a 48 x 32 one: 24), at the place the image is shown."""
    chat = _vision_chat()
    content = [{"type": "text", "text": "A"}, {"type": "image", "image": _picture(0)}, {"type": "text", "text": "B"},
               {"type": "image_url", "image_url": {"url": _data_url(_picture(1, 32).resize((48, 32)))}},
               {"type": "text", "text": "C"}]
    ids, images = chat.prompt_with_images([{"role": "user", "content": content}])
    image_id = chat.images.image_token_id
    assert [(i.start, i.length) for i in images] == [(4, 16), (4 + 16 + 3, 24)]
    assert [i.grid_thw.tolist() for i in images] == [[1, 8, 8], [1, 8, 12]]
    assert [tuple(i.pixel_values.shape) for i in images] == [(64, 48), (96, 48)]
    for image in images:
        assert ids[image.start - 1] == chat.tokenizer.convert_tokens_to_ids("<vision_start>")
        assert ids[image.start : image.end] == [image_id] * image.length
        assert ids[image.end] == chat.tokenizer.convert_tokens_to_ids("<vision_end>")
    assert ids.count(image_id) == 40
    text = chat.tokenizer.decode([t for t in ids if t != image_id])
    assert text == "<bos><user>A<vision_start><vision_end>B<vision_start><vision_end>C<eos><assistant>"


def test_images_where_treerl_takes_text_only_are_refused():
    shown = [{"role": "user", "content": [{"type": "image", "image": _picture()}, {"type": "text", "text": "?"}]}]
    with pytest.raises(UserError, match="prompt_with_images"):
        _vision_chat().prompt(shown)
    with pytest.raises(UserError, match="not a vision-language model"):
        ChatFormat(builtin_tokenizer()).prompt_with_images(shown)


def test_the_built_in_vision_tokens_are_the_vision_shapes_ids():
    tokenizer = builtin_tokenizer(vision=True)
    config = model_config(SHAPE, vocab_size=len(tokenizer))
    ids = tokenizer.convert_tokens_to_ids(["<image>", "<video>", "<vision_start>", "<vision_end>"])
    assert ids == [config.image_token_id, config.video_token_id, config.vision_start_token_id,
                   config.vision_end_token_id]
    assert len(builtin_tokenizer()) == len(tokenizer) - 4  # text shapes keep their vocabulary
    assert image_processor(model_config("tiny-qwen3", vocab_size=len(tokenizer))) is None


def test_a_llava_image_is_resized_to_its_tower_and_makes_one_token_a_patch():
    from vision_models import vl_model

    model = vl_model("llava")
    processor = ImageProcessor(model.config)
    span = processor.span(_picture(0, 20), start=3)
    assert tuple(span.pixel_values.shape) == (3, 8, 8) and span.length == 16 and span.grid_thw is None
    tokens = torch.tensor([1, 2, 3] + [model.config.image_token_id] * 16 + [4, 5])
    from treerl.tree import TokenSequence

    check_images(model, [TokenSequence(tokens, images=(span,))])  # the engines take it as it is


def _shapes_rollout(model, **options) -> Rollout:
    tokenizer = builtin_tokenizer(vision=True)
    config = RolloutConfig(task="shapes", prompts_per_step=3, group_size=4, temperature=2.0, **options)
    return Rollout(config, tokenizer, EmbeddedSampler(model), image_processor(model.config))


def test_the_shapes_task_samples_groups_on_shared_images_and_trains_exactly_what_it_sampled():
    """A step of the built-in shapes task: a group's samples share their prompt's image (one node of the tree, one
    image through the tower), and each reply token's behaviour log-prob is DfsEngine's recomputation on the sequence
    as sampled, image tokens the policy wrote included (text, as the sampler decoded them; temperature 2 writes
    some)."""
    tokenizer = builtin_tokenizer(vision=True)
    model = fresh_model(SHAPE, vocab_size=len(tokenizer))
    batch = _shapes_rollout(model, seed=2).collect(0)
    assert len(batch.sequences) == 12 and batch.stats.dropped == {}
    digests = {s.info["group"]: {i.digest for i in s.images} for s in batch.sequences}
    assert all(len(d) == 1 for d in digests.values()) and len(set.union(*digests.values())) == 3
    assert PrefixTree.build(batch.sequences).stats().compression > 3
    image_id = model.config.image_token_id
    wrote = sum(int((s.tokens[s.images[-1].end :] == image_id).sum()) for s in batch.sequences)
    outputs = DfsEngine(head=PolicyHead(temperature=2.0)).forward(model, batch.sequences)
    for sequence, out in zip(batch.sequences, outputs):
        reply = sequence.fields["loss_mask"] > 0
        assert torch.allclose(out["logprobs"][reply], sequence.fields["old_logprobs"][reply], atol=1e-9, rtol=0)
    assert wrote > 0  # seed 2's samples hold an image token the policy wrote


def test_the_shapes_task_counts_the_shapes_it_draws_and_needs_a_vision_model():
    task = Shapes(max_shapes=4, seed=2, image_size=48)
    prompts = task.prompts(5, 20)
    assert [p.answer for p in prompts] == [p.answer for p in task.prompts(5, 20)]
    for prompt in prompts:
        pixels = np.asarray(prompt.messages[0]["content"][0]["image"])
        cells = pixels.reshape(3, 16, 3, 16, 3).max(axis=(1, 3, 4)) > 0
        assert cells.sum() == prompt.answer and 1 <= prompt.answer <= 4
        assert prompt.text == "How many shapes?"
    assert {p.answer for p in prompts} == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="max_shapes"):
        Shapes(max_shapes=5)
    with pytest.raises(UserError, match="needs a vision-language model"):
        Rollout(RolloutConfig(task="shapes"), builtin_tokenizer(), EmbeddedSampler(fresh_model()))


def _zero(prompt, completion, answer):
    return 0.0


def test_a_datasets_image_column_shows_each_rows_images_at_its_markers(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(_picture(0)))
    rows = [{"prompt": "Count them.", "image": str(tmp_path / "a.png"), "answer": 2},
            {"prompt": "Left <image> right <image> same?", "image": [str(tmp_path / "a.png"), _data_url(_picture(1))]},
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "a.png")},
                                                     {"type": "text", "text": "?"}]}]},
            {"prompt": "no image here"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = DatasetTask.load(path, _zero, shuffle=False, eval_fraction=0)
    shown = [p.messages[-1]["content"] for p in task.prompts(0, 4)]
    assert [[part["type"] for part in c] for c in shown[:3]] == [["image", "text"], ["text", "image", "text", "image",
                                                                                    "text"], ["image", "text"]]
    assert shown[3] == "no image here" and task.prompts(0, 4)[1].text == "Left  right  same?"
    chat = _vision_chat()
    first, images = chat.prompt_with_images(task.prompts(0, 1)[0].messages)
    third, same = chat.prompt_with_images(task.prompts(0, 3)[2].messages)
    assert images[0].digest == same[0].digest  # one file, one image: the trees share it


def test_images_given_without_markers_go_before_the_text(tmp_path):
    """As the docs say: a row whose prompt has no <image> marker shows all its images before its text."""
    (tmp_path / "a.png").write_bytes(_png(_picture(0)))
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "Same?", "image": [str(tmp_path / "a.png")] * 2}) + "\n")
    [prompt] = DatasetTask.load(path, _zero).prompts(0, 1)
    assert [part["type"] for part in prompt.messages[-1]["content"]] == ["image", "image", "text"]


@pytest.mark.parametrize("row, options, says", [
    ({"prompt": "<image>How many?", "image": "/x.png"}, {"image_key": "picture"},
     r"data.jsonl:1: the prompt has 1 <image> marker\(s\) but no image: the row's field 'picture' holds none"),
    ({"prompt": "<image>How many?", "image": "/x.png"}, {"vision": False},
     r"data.jsonl:1: the prompt shows an image, but the model is not a vision-language model"),
])
def test_an_image_row_the_model_cannot_see_fails_when_the_data_loads(tmp_path, row, options, says):
    """A marker with no image would be trained as text (an image token without pixels); an image shown to a text
    model failed only at the first rollout, naming the prompt, not the row."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=says):
        DatasetTask.load(path, _zero, **options)


@pytest.mark.parametrize("row, says", [
    ({"prompt": "x", "image": "/missing.png"}, r"data.jsonl:1: image 0: image file '/missing.png' does not exist"),
    ({"prompt": "a <image> b", "image": ["/x.png", "/y.png"]}, "1 <image> markers but field 'image' holds 2 images"),
    ({"prompt": [{"role": "user", "content": [{"type": "video"}]}]}, "a list of text and image parts"),
])
def test_a_bad_image_row_fails_when_the_data_loads(tmp_path, row, says):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=says):
        DatasetTask.load(path, _zero)


def test_an_agents_screenshots_are_recorded_into_the_tree():
    """An OpenAI-SDK agent shows a screenshot, gets two replies, answers one with a second screenshot: the proxy
    records every call with its images (the second call extends the first token for token, its own screenshot placed
    after it), each reply's behaviour log-prob is DfsEngine's recomputation, and the tree holds the first screenshot
    once. An image the proxy cannot take is an HTTP 400 naming why."""
    import asyncio

    import openai

    from treerl.rollout.agents.proxy import ChatProxy
    from treerl.rollout.workflows.sequences import model_call_sequence

    tokenizer = builtin_tokenizer(vision=True)
    model = fresh_model(SHAPE, vocab_size=len(tokenizer))
    proxy = ChatProxy(EmbeddedSampler(model), ChatFormat(tokenizer, images=image_processor(model.config)),
                      max_new_tokens=4)
    proxy.start()

    def shot(seed: int) -> dict:
        return {"type": "image_url", "image_url": {"url": _data_url(_picture(seed))}}

    async def agent(client):
        first = [{"role": "user", "content": [shot(0), {"type": "text", "text": "Where?"}]}]
        answer = await client.chat.completions.create(model="policy", messages=first, n=2, seed=0)
        second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                          {"role": "user", "content": [{"type": "text", "text": "Now:"}, shot(1)]}]
        await client.chat.completions.create(model="policy", messages=second, seed=1)
        refused = []
        for bad in ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]}],
                    [{"role": "assistant", "content": [shot(0)]}, {"role": "user", "content": "?"}]):
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model="policy", messages=bad)
            refused.append(str(error.value))
        return refused

    async def main():
        client = openai.AsyncOpenAI(base_url=proxy.episode_url("e0"), api_key="x", max_retries=0)
        try:
            return await agent(client)
        finally:
            await client.close()

    proxy.recorder.open("e0")
    try:
        refused = asyncio.run(main())
    finally:
        calls = proxy.recorder.close("e0").calls
        proxy.stop()
    assert "must be a data URL" in refused[0] and "images are shown in user and tool messages only" in refused[1]
    assert len(calls) == 3 and calls[2].parent == 0
    extended = calls[0].prompt + calls[0].completion.tokens
    assert calls[2].prompt[: len(extended)] == extended
    assert calls[2].images[0] is calls[0].images[0] and calls[2].images[1].start > len(extended)
    assert calls[2].images[1].digest != calls[0].images[0].digest
    sequences = [model_call_sequence(c.prompt, c.completion, {}, f"call{c.index}", images=c.images) for c in calls]
    for sequence, out in zip(sequences, DfsEngine().forward(model, sequences)):
        reply = sequence.fields["loss_mask"] > 0
        assert torch.allclose(out["logprobs"][reply], sequence.fields["old_logprobs"][reply], atol=1e-9, rtol=0)
    stats = PrefixTree.build(sequences).stats()
    assert stats.unique_tokens < stats.flat_tokens - 2 * 16  # the first screenshot's 16 tokens held once, not 3 times


def test_the_responses_api_shows_input_images_as_chat_image_parts():
    from treerl.rollout.agents.responses_api import input_messages

    url = _data_url(_picture(0))
    [message] = input_messages([{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Where?"}, {"type": "input_image", "image_url": url}]}])
    assert message["content"] == [{"type": "text", "text": "Where?"}, {"type": "image_url", "image_url": {"url": url}}]
    ids, [image] = _vision_chat().prompt_with_images([message])
    assert image.length == 16


class _Screens:
    """A GUI-like environment: every answer shows a new screenshot (drawn from the turn and the reply's length)."""

    def __init__(self, broken: bool = False):
        self.turn, self.broken = 0, broken

    def step(self, reply: str):
        from treerl.rollout.tasks.base import EnvReply

        self.turn += 1
        shot = "data:image/png;base64,AAAA" if self.broken else _picture(10 * self.turn + len(reply))
        return EnvReply([{"role": "user", "content": [{"type": "text", "text": "Now:"},
                                                      {"type": "image", "image": shot}]}], reward=0.5)


class _ScreenTask:
    name, max_new_tokens, max_turns = "screens", 3, 3

    def __init__(self, broken: bool = False):
        self.broken = broken

    def prompts(self, step, count):
        from treerl.rollout.tasks.base import Prompt

        return [Prompt(f"p{i}", [{"role": "user", "content": [{"type": "image", "image": _picture(i)},
                                                              {"type": "text", "text": "Go"}]}]) for i in range(count)]

    def environment(self, prompt):
        return _Screens(self.broken)


def test_an_environment_shows_a_screenshot_a_turn_and_the_branches_share_the_earlier_ones():
    from treerl.rollout.workflows.multi_turn import MultiTurnWorkflow
    from treerl.rollout.workflows.stats import RolloutStats

    tokenizer = builtin_tokenizer(vision=True)
    model = fresh_model(SHAPE, vocab_size=len(tokenizer))
    chat = ChatFormat(tokenizer, images=image_processor(model.config))
    workflow = MultiTurnWorkflow(_ScreenTask(), chat, SamplingParams(max_new_tokens=3), group_size=2, branch_at=(1,),
                                 branch_factor=2, max_turns=3)
    sequences = workflow.run(EmbeddedSampler(model), _ScreenTask().prompts(0, 1), RolloutStats(), seed=0)
    assert len(sequences) == 4 * 3  # 2 replies, each forked in 2 at turn 1: 4 trajectories of 3 calls
    for sequence in sequences:
        assert len(sequence.images) == sequence.info["turn"] + 1
    first = {s.info["trajectory"]: s.images for s in sequences if s.info["turn"] == 1}
    a, b = [v for k, v in first.items() if k.startswith("p0/0")]
    assert a == b  # both branches of a fork hold the same screenshots up to it, at the same places
    for sequence, out in zip(sequences, DfsEngine().forward(model, sequences)):
        reply = sequence.fields["loss_mask"] > 0
        assert torch.allclose(out["logprobs"][reply], sequence.fields["old_logprobs"][reply], atol=1e-9, rtol=0)
    stats = RolloutStats()
    broken = MultiTurnWorkflow(_ScreenTask(broken=True), chat, SamplingParams(max_new_tokens=3), group_size=2,
                               branch_at=(), max_turns=2)
    assert broken.run(EmbeddedSampler(model), _ScreenTask().prompts(0, 1), stats, seed=0) == []
    assert stats.dropped == {"environment_image": 2}
    assert "the environment's answer at turn 0, image 0: cannot read the image" in stats.dropped_samples[0].reason


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl", "qwen3_5", "llava"])
def test_each_familys_processor_makes_images_its_engines_train_exactly(name):
    """The image processor built from each family's config makes spans the engines take (patch rows of the tower's
    width, the grid, the placeholder count), and DfsEngine's log-probs on them are the flat reference's."""
    from vision_models import END, START, vl_model

    from treerl.engine import FlatEngine
    from treerl.tree import TokenSequence

    model = vl_model(name)
    processor = ImageProcessor(model.config)
    sequences = []
    for seed in (0, 0, 1):
        span = processor.span(_picture(seed, 16), start=3)
        tokens = [1, 5, START] + [processor.image_token_id] * span.length + [END, 7, 8 + seed]
        sequences.append(TokenSequence(torch.tensor(tokens), images=(span,)))
    assert sequences[0].images[0].digest == sequences[1].images[0].digest != sequences[2].images[0].digest
    with float64_throughout():  # transformers' norms and delta rule compute in float32 otherwise (Qwen3.5: 1e-8)
        pairs = zip(DfsEngine().forward(model, sequences), FlatEngine(layout="sequences").forward(model, sequences))
        for dfs, flat in pairs:
            assert torch.allclose(dfs["logprobs"], flat["logprobs"], atol=1e-12, rtol=0)
