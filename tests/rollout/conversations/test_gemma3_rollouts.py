"""Gemma 3's rollouts: its chat template writes <start_of_image>, which its processor expands in the text (newlines
around the image's tokens, merged by the tokenizer with the text's own), so treerl tokenizes a prompt after that
expansion, as transformers' Gemma3Processor does: the ids, pixels and image places are the processor's own, an agent's
later screenshot extends the context token for token, and what the sampler samples is what the engines train."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
from vision_models import gemma3_model, gemma_tokenizer

from treerl.engine import DfsEngine, FlatEngine
from treerl.engine.images import check_images
from treerl.errors import UserError
from treerl.rollout import EmbeddedSampler
from treerl.rollout.conversations.chat import ChatFormat
from treerl.rollout.conversations.images import ImageProcessor, expand_images
from treerl.rollout.sampling.sampler import SamplingParams
from treerl.tree import PrefixTree, TokenSequence


def _picture(seed: int, height: int = 10, width: int = 12) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _setup():
    tokenizer = gemma_tokenizer()
    model = gemma3_model(tokenizer)
    images = ImageProcessor(model.config)
    chat = ChatFormat(tokenizer, stop_tokens=["<end_of_turn>"], images=images)
    return tokenizer, model, images, chat


def _question(seed: int, text: str = "How many?") -> list[dict]:
    """The image first, as Gemma's users write it: the processor's "\n\n" meets the template's "user\n"."""
    return [{"role": "user", "content": [{"type": "image", "image": _picture(seed)}, {"type": "text", "text": text}]}]


def _processor(tokenizer, images: ImageProcessor) -> Gemma3Processor:
    return Gemma3Processor(image_processor=images.processor, tokenizer=tokenizer, image_seq_length=4,
                           chat_template=tokenizer.chat_template)


def test_a_prompt_is_the_processors_own_ids_pixels_and_image_places():
    tokenizer, model, images, chat = _setup()
    messages = _question(0)
    ids, spans = chat.prompt_with_images(messages)
    theirs = _processor(tokenizer, images).apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                               return_dict=True, return_tensors="pt")
    assert ids == theirs["input_ids"][0].tolist()
    assert len(spans) == 1 and torch.equal(spans[0].pixel_values, theirs["pixel_values"][0].float())
    shown = torch.zeros(len(ids), dtype=torch.long)
    shown[spans[0].start : spans[0].start + spans[0].length] = 1
    assert torch.equal(shown, theirs["token_type_ids"][0])
    # Expanding the template's ids instead would not give these: the tokenizer merges "\n\n" with the text's newlines.
    text_only = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True)
    assert tokenizer.convert_tokens_to_ids("\n\n\n") in ids and tokenizer.convert_tokens_to_ids("\n\n\n") not in text_only
    check_images(model, [TokenSequence(torch.tensor(ids), images=spans)])


def test_pan_and_scan_crops_are_images_of_their_own():
    """A checkpoint's preprocessor config that asks for pan & scan: each crop is one more image span, as the
    processor writes them (the original, then the crops)."""
    tokenizer, model, images, chat = _setup()
    for key, value in (("do_pan_and_scan", True), ("pan_and_scan_min_crop_size", 4),
                       ("pan_and_scan_max_num_crops", 4), ("pan_and_scan_min_ratio_to_activate", 1.2)):
        setattr(images.processor, key, value)
    messages = [{"role": "user", "content": [{"type": "image", "image": _picture(0, 10, 40)}]}]
    ids, spans = chat.prompt_with_images(messages)
    text = chat.render_text(messages, add_generation_prompt=True)
    theirs = _processor(tokenizer, images)(text=[text], images=[[_picture(0, 10, 40)]], add_special_tokens=False,
                                           return_tensors="pt", do_pan_and_scan=True, pan_and_scan_min_crop_size=4,
                                           pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
    assert ids == theirs["input_ids"][0].tolist() and len(spans) == len(theirs["pixel_values"]) > 1
    for span, pixels in zip(spans, theirs["pixel_values"]):
        assert torch.equal(span.pixel_values, pixels.float()) and ids[span.start - 1] == images.config.boi_token_id
    check_images(model, [TokenSequence(torch.tensor(ids), images=spans)])


def test_an_agents_later_screenshot_extends_the_context_token_for_token():
    """Prompt, reply, then a user turn with a second screenshot: the context and its continuation are the processor's
    ids of the whole conversation, each screenshot where the processor puts it."""
    tokenizer, model, images, chat = _setup()
    first = _question(0)
    prompt, shown = chat.prompt_with_images(first)
    reply = tokenizer.encode("Two.", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    later = [{"role": "user", "content": [{"type": "text", "text": "And\nnow:"}, {"type": "image", "image": _picture(1)}]}]
    more, screenshots = chat.continuation_with_images(later, offset=len(prompt) + len(reply))
    whole = first + [{"role": "assistant", "content": "Two."}] + later
    theirs = _processor(tokenizer, images).apply_chat_template(whole, tokenize=True, add_generation_prompt=True,
                                                               return_dict=True, return_tensors="pt")
    assert prompt + reply + more == theirs["input_ids"][0].tolist()
    places = [s.start for s in shown + screenshots]
    assert places == [i for i, t in enumerate(theirs["token_type_ids"][0].tolist())
                      if t == 1 and theirs["token_type_ids"][0][i - 1] == 0]
    assert torch.equal(screenshots[0].pixel_values, theirs["pixel_values"][1].float())


def test_what_the_sampler_samples_from_an_image_prompt_is_what_the_engines_train():
    """A GRPO group on one Gemma 3 image prompt (its image tokens attend both ways): the behaviour log-probs are
    DfsEngine's recomputation, DfsEngine equals the flat reference, and the tree holds the prompt's image once."""
    tokenizer, model, images, chat = _setup()
    prompt, spans = chat.prompt_with_images(_question(0))
    params = SamplingParams(n=3, max_new_tokens=5, seed=0, stop_token_ids=chat.stop_token_ids)
    completions = EmbeddedSampler(model).generate([prompt], params, images=[spans])[0]
    sequences = [TokenSequence(torch.tensor(prompt + c.tokens), images=spans) for c in completions]
    dfs = DfsEngine().forward(model, sequences)
    flat = FlatEngine(layout="sequences").forward(model, sequences)
    for completion, ours, reference in zip(completions, dfs, flat):
        sampled = torch.tensor(completion.logprobs, dtype=torch.float64)
        assert torch.allclose(ours["logprobs"][len(prompt):], sampled, atol=1e-9, rtol=0)
        assert torch.allclose(ours["logprobs"], reference["logprobs"], atol=1e-10, rtol=0)
    stats = PrefixTree.build(sequences).stats()
    assert stats.unique_tokens <= stats.flat_tokens - 2 * len(prompt)


def test_a_gemma3_prompt_the_template_or_tokenizer_cannot_place_is_refused():
    tokenizer, model, images, chat = _setup()
    text = chat.render_text(_question(0), add_generation_prompt=True)
    with pytest.raises(UserError, match="shows 2 images, but the chat template wrote 1 <start_of_image>"):
        images.tokenize_with_images(text, [_picture(0), _picture(1)], tokenizer, "row 3")
    plain = gemma_tokenizer()
    plain.boi_token = None
    with pytest.raises(UserError, match="names no boi_token"):
        images.tokenize_with_images(text, [_picture(0)], plain, "row 3")
    with pytest.raises(ValueError, match="expands its images in the text"):
        expand_images([1, 2], [_picture(0)], images, "row 3")


def test_a_gemma3_checkpoint_trains_on_the_shapes_task(tmp_path):
    """`treerl train shapes model.path=<a Gemma 3 checkpoint>`: its own tokenizer, template and preprocessor config
    (read from the folder, nothing downloaded) build the image prompts, which are sampled and trained on."""
    import json

    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from typer.testing import CliRunner

    from treerl.cli.main import app
    from treerl.trainer.core.checkpoint import checkpoint_dir, read_weights

    tokenizer = gemma_tokenizer()
    folder = tmp_path / "gemma3"
    gemma3_model(tokenizer).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": 8, "width": 8}).save_pretrained(folder)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "shapes", f"model.path={folder}", "rollout.stop_tokens=[<end_of_turn>]",
                                      "rollout.max_context_tokens=512", "trainer.steps=2", "trainer.save_every=2",
                                      "rollout.prompts_per_step=2", "trainer.eval_prompts=2", "trainer.progress=false",
                                      "trainer.tensorboard=false", f"trainer.output_dir={out}"])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "batch/sequences" in s]
    assert len(trained) == 2 and all(s["batch/sequences"] > 0 and s["rollout/dropped"] == 0 for s in trained)
    before, after = read_weights(folder), read_weights(checkpoint_dir(out, 2))
    for name in ("vision_tower.embeddings.patch_embedding.weight", "multi_modal_projector.mm_input_projection_weight"):
        assert not torch.allclose(after[name].float(), before[name].float()), name  # the images reached the tower
