"""Vision-language trees: images in shared prompts and agent turns, one vision pass per image, exact.

Tiny random Qwen2-VL and Qwen2.5-VL builds (a 2-block vision tower that merges 2x2 patches, multimodal RoPE with
(t, h, w) sections), a Qwen3-VL (DeepStack features added in the text body's first two layers), a Qwen3.5 (Gated DeltaNet and attention layers, the same tower) and a LLaVA (a 2-layer CLIP tower on 8x8 images, 16 patch tokens, 1-D positions) in float64
throughout: DfsEngine equals the model's own forward on each sequence alone (pixels, grids and token types as the
processor hands them over) and the flat reference's gradient, the vision tower's included, in every plan; the tower
runs once per distinct image a step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import assert_bf16_no_worse_than_flat, float64_throughout, fresh_model
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from vision_models import BUILDS, TEXT, sequence, vl_model

from treerl.attention import UnsupportedModel
from treerl.bench.peak import peak_memory
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.engine.images import sequence_positions
from treerl.testing import assert_engines_agree, assert_matches_model, compare_runs, run_engine
from treerl.tree import ImageSpan, TokenSequence

# float64 throughout: rounding. Qwen3.5's Gated DeltaNet amplifies it in a small parameter's gradient (A_log: 3e-11,
# as tests/engine/test_recurrent.py's EXACT allows), and CLIP's (SigLIP's) key bias has a gradient that is zero in exact arithmetic
# (softmax ignores a bias shared by every key: 1e-12 of rounding, read against the floor); the whole gradient and the
# outputs stay near 1e-15.
TOL = {"qwen2_5_vl": 1e-12, "qwen2_vl": 1e-12, "qwen3_vl": 1e-12, "qwen3_5": 1e-9, "llava": 1e-10, "gemma3": 1e-10}
def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


def grpo_and_agent(name: str = "qwen2_5_vl") -> list[TokenSequence]:
    """A GRPO group on one image prompt, the same text on another image (of another size where the model takes any),
    an agent episode with a screenshot a turn and a retry on a different last screenshot, and a text-only sequence."""
    prompt = [[1, 5, 6], (0, 4, 4), [7]]
    parts = [prompt + [[8, 9, 10]], prompt + [[11, 12]], prompt + [[8, 13]], [[1, 5, 6], (1, 4, 6), [7, 8, 9]],
             [[1, 5], (0, 4, 4), [20], (2, 2, 4), [21, 22]],
             [[1, 5], (0, 4, 4), [20], (2, 2, 4), [21], (3, 4, 4), [23]],
             [[1, 5], (0, 4, 4), [20], (2, 2, 4), [21], (4, 4, 4), [24, 25]], [[1, 5, 6, 7, 8]]]
    return [sequence(p, seed, llava=name == "llava") for seed, p in enumerate(parts, 1)]


PLANS = {"default": DfsEngine(), "chunk-3": DfsEngine(chunk_tokens=3),
         "per-node-recompute": DfsEngine(chunk_tokens=2, batch_tokens=0, recompute="always")}
ORACLE = FlatEngine(layout="sequences")


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", BUILDS)
def test_images_in_shared_prompts_and_agent_turns_are_exact(name, plan):
    model, batch = vl_model(name), grpo_and_agent(name)
    with float64_throughout():
        assert_matches_model(model, batch, PLANS[plan].forward(model, batch), tol=1e-12)
        errors = compare_runs(run_engine(PLANS[plan], model, batch, _loss), run_engine(ORACLE, model, batch, _loss))
    assert max(errors.values()) <= TOL[name], errors
    assert any(k.startswith(("grad.model.visual.", "grad.model.vision_tower.")) for k in errors)  # the tower's too


def test_the_vision_tower_runs_once_per_distinct_image_a_step_and_once_more_for_its_backward():
    """Forward: one call on every distinct image, without a graph; backward: each image again, alone, with one."""
    model, batch = vl_model("qwen2_5_vl"), grpo_and_agent()
    calls = []
    hook = model.model.visual.register_forward_hook(
        lambda m, args, out: calls.append((args[0].shape[0], torch.is_grad_enabled())))
    try:
        DfsEngine().forward_backward(model, batch, _loss)
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    distinct = {i.digest: i for s in batch for i in s.images}
    assert len(distinct) == 5 and sum(len(s.images) for s in batch) == 12
    patches = [int(i.grid_thw.prod()) for i in distinct.values()]
    assert calls == [(sum(patches), False)] + [(p, True) for p in patches]


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_5"])
def test_measured_peak_within_the_flat_references_with_images(name):
    """The contract holds with images: flat runs each sequence that shows images in its own call (text graph and its
    images' vision graph); DfsEngine's walk holds at most that call's text graph, the tables' leaves, and at the end
    one image's vision graph alone."""
    model, batch = vl_model(name), grpo_and_agent(name)

    def peak(engine):
        held = peak_memory(lambda: engine.forward_backward(model, batch, _loss))
        model.zero_grad(set_to_none=True)
        return held

    flat, dfs = peak(ORACLE), peak(DfsEngine())
    assert dfs <= flat, f"DfsEngine held {dfs / 2**10:.0f} KiB, flat's one-sequence call {flat / 2**10:.0f} KiB"


def test_a_frozen_vision_tower_gets_no_gradient_and_the_rest_stays_exact():
    model, batch = vl_model("qwen2_vl"), grpo_and_agent()
    model.model.visual.requires_grad_(False)
    try:
        with float64_throughout():
            assert_engines_agree(model, batch, _loss, DfsEngine(chunk_tokens=3), ORACLE, tol=1e-12)
        model.zero_grad(set_to_none=True)
        DfsEngine().forward_backward(model, batch, _loss)
        assert all(p.grad is None for p in model.model.visual.parameters())
        assert model.lm_head.weight.grad is not None
    finally:
        model.model.visual.requires_grad_(True)
        model.zero_grad(set_to_none=True)


@pytest.mark.slow  # ~10 s on 2 cores
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(st.lists(st.one_of(st.integers(4, 6), st.integers(0, 2).map(lambda s: (s, 2, 4))), min_size=1,
                               max_size=4), min_size=1, max_size=5),
       chunk=st.sampled_from([1, 2, 3, 2048]), batch_tokens=st.sampled_from([0, 8, 8192]),
       name=st.sampled_from(["qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava"]))
def test_random_trees_of_text_and_images(turns, chunk, batch_tokens, name):
    """Sequences of a few text tokens and images out of three (Qwen-VL: two placeholder tokens each), a token of text
    closing each: images shared or not, nodes cut inside an image, below it and across it; Qwen3.5's rows padded."""
    batch = [sequence([[1]] + [p if isinstance(p, tuple) else [p] for p in parts] + [[9]], seed, llava=name == "llava")
             for seed, parts in enumerate(turns)]
    model = vl_model(name)
    with float64_throughout():
        assert_engines_agree(model, batch, _loss, DfsEngine(chunk_tokens=chunk, batch_tokens=batch_tokens), ORACLE,
                             tol=TOL[name])


def test_bfloat16_error_no_larger_than_the_flat_references():
    low = vl_model("qwen2_5_vl").float()
    high = BUILDS["qwen2_5_vl"]().double().eval()
    high.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
    try:
        batch = [_to(s, torch.float32) for s in grpo_and_agent()]
        assert_bf16_no_worse_than_flat(low, high, batch, _loss, DfsEngine(chunk_tokens=3), ORACLE)
    finally:
        low.double()


def test_gemma3s_bfloat16_error_no_larger_than_the_flat_references():
    """Under bf16 autocast the both-ways blocks (the exact math kernel, at float32 or wider) keep DfsEngine's error
    that of the flat reference (the model's own masks). On so small a batch one draw's ratio scatters from 0.8 to 1.4
    either way (measured over 8 draws of the images), so the bound is on the mean over 6 draws."""
    from support import BF16_RATIO

    high, low = _gemma3(), _gemma3().float()
    ratios: dict[str, list[float]] = {part: [] for part in BF16_RATIO}
    for draw in range(6):
        g, pixels = torch.Generator().manual_seed(draw), {}
        batch = [TokenSequence(s.tokens, fields={"advantages": s.fields["advantages"].float()}, images=tuple(
            ImageSpan(i.start, i.length, pixels.setdefault(i.digest, torch.randn(3, 8, 8, generator=g)))
            for i in s.images)) for s in _gemma3_batch()]  # the same image where the batch shows one twice
        reference = run_engine(ORACLE, high, batch, _loss)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            flat = compare_runs(run_engine(ORACLE, low, batch, _loss), reference)
            ours = compare_runs(run_engine(DfsEngine(chunk_tokens=3), low, batch, _loss), reference)
        for part in BF16_RATIO:
            worst = lambda errors, part=part: max(e for k, e in errors.items() if k.endswith(part))
            ratios[part].append(worst(ours) / worst(flat))
    for part, ratio in BF16_RATIO.items():
        assert sum(ratios[part]) / len(ratios[part]) <= ratio, (part, ratios[part])


def _to(s: TokenSequence, dtype: torch.dtype) -> TokenSequence:
    images = tuple(ImageSpan(i.start, i.length, i.pixel_values.to(dtype), i.grid_thw) for i in s.images)
    return TokenSequence(s.tokens, fields=s.fields, images=images)


@pytest.mark.parametrize("build, says", [
    (lambda: fresh_model(vocab_size=128), "is not a vision-language model whose images treerl feeds"),
    (lambda: vl_model("qwen2_5_vl"), r"image 0 at tokens \[4, 8\): its grid \[1, 4, 6\] makes 6 placeholder tokens"),
])
def test_images_a_model_cannot_take_are_refused_before_compute(build, says):
    model = build()
    batch = [sequence([[1, 5, 6], (0, 4, 4), [7, 8]])]
    if "grid" in says:
        spans = batch[0].images
        pixels = torch.randn(24, 12, dtype=torch.float64)
        batch[0].images = (ImageSpan(spans[0].start, 4, pixels, torch.tensor([1, 4, 6])),)
    calls = []
    hook = model.get_input_embeddings().register_forward_hook(lambda *a: calls.append(1))
    try:
        for engine in (DfsEngine(), FlatEngine()):
            with pytest.raises(UnsupportedModel, match=says):
                engine.forward(model, batch)
    finally:
        hook.remove()
    assert calls == []


def _gemma3(window: int = 4) -> torch.nn.Module:
    """Gemma 3 (a 1-layer SigLIP tower on 8 x 8 images pooled to 4 tokens), its sliding window (4) shorter than a
    sequence, so the window binds around the images (3: inside them too, where it hides an image's first token from its
    last although they attend both ways)."""
    torch.manual_seed(0)
    text = {**TEXT, "vocab_size": 300, "head_dim": 8, "sliding_window": window, "rope_parameters": None,
            "layer_types": ["sliding_attention", "full_attention"]}
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                         "num_attention_heads": 4, "image_size": 8, "patch_size": 2},
        mm_tokens_per_image=4, image_token_index=260, boi_token_index=255, eoi_token_index=256)).double().eval()
    with torch.no_grad():  # initialised to zero, it would show every image as zeros (and cut the tower's gradient)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    return model


def _gemma3_batch() -> list[TokenSequence]:
    """A group on one image, the same text on another, and two images in one sequence (each its own block)."""
    g = torch.Generator().manual_seed(0)
    shots = [torch.randn(3, 8, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    image = [255, 260, 260, 260, 260, 256]
    out = []
    for seed, (parts, shown) in enumerate([([2, 5, *image, 7, 8], [0]), ([2, 5, *image, 7, 9, 10], [0]),
                                           ([2, 5, *image, 7, 8], [1]), ([2, *image, 6, *image, 11, 12], [0, 2])]):
        starts = [k + 1 for k, t in enumerate(parts) if t == 255]
        images = tuple(ImageSpan(start, 4, shots[i]) for start, i in zip(starts, shown))
        advantages = torch.randn(len(parts), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        out.append(TokenSequence(torch.tensor(parts), images=images, fields={"advantages": advantages}))
    return out


@pytest.mark.parametrize("window", [4, 3])
def test_gemma3s_images_attend_both_ways_in_every_plan(window):
    """Gemma 3 lets an image's tokens attend to each other both ways (on sliding layers: within the window). DfsEngine
    adds each image's later keys to its tokens' attention, and no piece of a chunked node cuts an image (chunk-3 would
    cut these 4-token images): equal to the model's own forward on each sequence alone and to the flat reference (the
    model's own masks), gradients reaching the vision tower."""
    model, batch = _gemma3(window), _gemma3_batch()
    worst = worst_over_plans(model, batch)
    assert worst <= TOL["gemma3"], worst
    model.zero_grad(set_to_none=True)
    DfsEngine(chunk_tokens=3).forward_backward(model, batch, _loss)
    patches = next(p for n, p in model.model.vision_tower.named_parameters() if "patch_embedding.weight" in n)
    assert patches.grad.abs().sum() > 0
    assert model.model.multi_modal_projector.mm_input_projection_weight.grad.abs().sum() > 0


def test_a_critic_reads_the_images_and_its_values_are_exact():
    """A vision-language policy's critic (its model with a value layer for its LM head): DfsEngine's values and
    gradients, the tower's included, equal the flat reference's."""
    from treerl.algo.critic import with_value_layer
    from treerl.engine import ValueHead

    torch.manual_seed(0)
    critic = with_value_layer(BUILDS["qwen2_5_vl"]().double().eval(), seed=1)
    batch = grpo_and_agent()
    values_loss = lambda view: ((view.values - view.fields["advantages"]) ** 2).sum()
    with float64_throughout():
        errors = compare_runs(run_engine(DfsEngine(head=ValueHead(), chunk_tokens=3), critic, batch, values_loss),
                              run_engine(FlatEngine(head=ValueHead(), layout="sequences"), critic, batch, values_loss))
    assert max(errors.values()) <= TOL["qwen2_5_vl"], errors
    assert any(k.startswith("grad.model.visual.") for k in errors) and "grad.score.weight" in errors


def test_the_packing_engine_refuses_images():
    with pytest.raises(UnsupportedModel, match="does not feed images yet; DfsEngine and FlatEngine do"):
        PackedEngine().forward(vl_model("qwen2_vl"), grpo_and_agent())


def test_an_image_that_ends_a_sequence_is_refused():
    batch = [sequence([[1, 5], (0, 4, 4)])]
    batch[0].tokens = batch[0].tokens[:-1]  # drop the END token: the image's last placeholder is the last token
    batch[0].fields = {}
    with pytest.raises(UnsupportedModel, match="ends the sequence"):
        DfsEngine().forward(vl_model("qwen2_vl"), batch)



@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_5"])
def test_an_image_token_the_policy_wrote_is_text_as_it_was_sampled(name):
    """A random policy writes the image placeholder now and then: outside an image it is text (its embedding, the next
    position on every rotary axis), as the sampler decoded it; every engine trains it so, in agreement."""
    from vision_models import IMAGE

    model = vl_model(name)
    wrote = sequence([[1, 5, 6], (0, 4, 4), [7, IMAGE, 9, IMAGE, 10]], seed=1)
    again = sequence([[1, 5, 6], (0, 4, 4), [7, IMAGE, 11]], seed=2)
    positions = sequence_positions(model, wrote)
    after = wrote.images[0].end + 1  # the token after END
    assert torch.equal(positions[1:, after:], positions[1:, after - 1 : after] + torch.arange(1, 6))
    with float64_throughout():
        errors = compare_runs(run_engine(PLANS["chunk-3"], model, [wrote, again], _loss),
                              run_engine(ORACLE, model, [wrote, again], _loss))
    assert max(errors.values()) <= TOL[name], errors


def worst_over_plans(model, batch) -> float:
    """The largest error, in any plan of `PLANS` (float64 throughout), of DfsEngine's log-probs against the model's own
    forward on each sequence alone (bounded by 1e-12 on the way) and of its whole run against the flat reference."""
    worst = 0.0
    with float64_throughout():
        for engine in PLANS.values():
            worst = max(worst, assert_matches_model(model, batch, engine.forward(model, batch), tol=1e-12))
            errors = compare_runs(run_engine(engine, model, batch, _loss), run_engine(ORACLE, model, batch, _loss))
            worst = max(worst, *errors.values())
    return worst


def multimodal_section() -> list[str]:
    """docs/models.md's vision-language table: the types served with images, each measured here (every plan of
    `PLANS` against the model's own forward and the flat reference, float64 throughout), and what is refused."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from treerl.engine.images import REFUSED_WITH_IMAGES, VISION_LANGUAGE

    lines = ["", "## Vision-language models", "",
             "Generated with the table above, from tests/engine/test_images.py: tiny random builds in float64 throughout,",
             "a GRPO group on one image prompt, the same text on another image, an agent episode with a screenshot a",
             "turn and a retry on another last screenshot, and a text-only sequence. **exact**: DfsEngine's log-probs",
             "equal the model's own forward on each sequence alone (pixels, grids and token types as its processor",
             "hands them over) and its whole gradient, the vision tower's included, the flat reference's, in every",
             "plan; the figure bounds the worst error. The vision tower runs once per distinct image a step.", "",
             "| model type | DfsEngine with images |", "|---|---|"]
    for name in BUILDS:
        worst = worst_over_plans(vl_model(name), grpo_and_agent(name))
        assert worst <= TOL[name], (name, worst)
        lines.append(f"| {name} | exact (<= {next(b for b in (1e-12, 1e-9, 1e-6) if worst <= b):g}) |")
    worst = worst_over_plans(_gemma3(), _gemma3_batch())  # its own batch: images of one size, start/end tokens
    assert worst <= TOL["gemma3"], worst
    lines.append(f"| gemma3 | exact (<= {next(b for b in (1e-12, 1e-9, 1e-6) if worst <= b):g}); an image's tokens "
                 "attend to each other both ways (a block per image), and no chunk cuts an image |")
    lines += [f"| {kind} | refused: {reason} |" for kind, reason in sorted(REFUSED_WITH_IMAGES.items())]
    others = sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(VISION_LANGUAGE) - set(REFUSED_WITH_IMAGES))
    refused = f"The other {len(others)} image-text-to-text types of the installed transformers are refused with images"
    lines += ["", refused + ", before compute",
              "(their tower, positions and placeholder layout are not in `treerl.engine.images.VISION_LANGUAGE` yet);",
              "every engine trains them on text. PackedEngine refuses images."]
    assert set(VISION_LANGUAGE) == set(BUILDS) | {"gemma3"}, "every served family is measured here"
    return lines


def test_gemma3s_sampler_prefills_images_both_ways_as_the_flat_reference_trains_them():
    """The embedded sampler prefills a Gemma 3 image prompt with the model's own masks (left-padded beside a longer
    prompt): each sampled token's behaviour log-prob is what FlatEngine recomputes."""
    from treerl.engine import PolicyHead
    from treerl.rollout.sampling.embedded import EmbeddedSampler
    from treerl.rollout.sampling.sampler import SamplingParams

    model = _gemma3()
    prompts = [s for s in _gemma3_batch() if len(s.images) < 2][:1] + _gemma3_batch()[3:]
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    results = EmbeddedSampler(model).generate([p.tokens.tolist() for p in prompts], params,
                                              images=[p.images for p in prompts])
    sequences, behaviour = [], []
    for prompt, group in zip(prompts, results):
        for completion in group:
            sequences.append(TokenSequence(torch.cat([prompt.tokens, torch.tensor(completion.tokens)]),
                                           images=prompt.images))
            behaviour.append((len(prompt), torch.tensor(completion.logprobs, dtype=torch.float64)))
    for out, (start, logprobs) in zip(FlatEngine(head=PolicyHead()).forward(model, sequences), behaviour):
        assert torch.allclose(out["logprobs"][start:], logprobs, atol=1e-9, rtol=0), (out["logprobs"][start:], logprobs)
