"""Mutation testing by hand: put one small, realistic bug into the code, run the tests that should catch it.

    python tools/mutate.py                          # every mutation below, each against its tests
    python tools/mutate.py staleness-off-by-one     # the named ones
    python tools/mutate.py --list                   # names, files and the bug each one is

Each mutation replaces one exact piece of source text (it must occur exactly once and the result must
compile: a mutation that no longer applies is an error, and `tests/test_mutations.py` says so in the suite),
runs `python -m pytest -x <its tests>` with this checkout's src/ first on the path, and writes the file back
from memory (also on Ctrl-C), so uncommitted edits elsewhere are left as they were; no git command runs.
"caught by" names the first test that failed; a SURVIVOR is a bug the suite lets through: add a test that
fails on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # exact source text, found once in `path`
    new: str
    tests: tuple[str, ...]  # pytest targets expected to catch it
    bug: str  # what a user would meet


MUTATIONS = [
    # ------------------------------------------------------------------ positions from the call's length (issue 32)
    Mutation("positions-from-the-call", "src/treerl/engine/support.py",
             '"position_ids": row}', '"position_ids": row - row[0]}',
             ("tests/engine/test_model_features.py::test_every_engine_equals_the_models_own_forward",),
             "BART's family: a tree node's tokens get the position embeddings of a sequence's first tokens"),
    Mutation("own-code-attention-without-the-path", "src/treerl/attention/tree_attention.py",
             "return _over_path(key, value, self.path, self.unit, self.layout.path_end, slot)",
             "return _over_path(key, value, None, self.unit, self.layout.path_end, slot)",
             ("tests/engine/test_own_attention.py::test_attention_in_the_models_own_code_is_exact",),
             "Bloom, Falcon, MVP ...: a tree node's own-code attention sees its own tokens, not its ancestors'"),
    Mutation("own-code-path-gradient-dropped", "src/treerl/attention/tree_attention.py",
             "        if ctx.path.with_grads:\n            ctx.path.add_ancestor_grads(",
             "        if False:\n            ctx.path.add_ancestor_grads(",
             ("tests/engine/test_own_attention.py::test_attention_in_the_models_own_code_is_exact",),
             "the gradient an own-code (or dense) attention sends to its ancestors' K/V is lost"),
    Mutation("dynamic-mask-ties-by-width", "src/treerl/engine/dfs.py",
             "else contextlib.nullcontext(), earliest_mask_ties(self.model), \\",
             "else contextlib.nullcontext(), contextlib.nullcontext(), \\",
             ("tests/engine/test_own_attention.py::test_attention_in_the_models_own_code_is_exact",),
             "Doge's top-k picks among keys tied at the k-th score by the CPU kernel's width, unlike the flat reference"),
    Mutation("own-code-probe-trusts-the-cache", "src/treerl/engine/base.py",
             "    if tail.shape[1] != 1 or not off <= 1e-2:", "    if False:",
             ("tests/engine/test_refusals.py::test_a_body_that_reads_the_cache_some_other_way_is_refused_before_compute",),
             "a body that reads the cache some other way (XLM) is taken for own-code attention and fails mid-walk"),
    Mutation("top-k-ties-exact-only", "src/treerl/engine/recurrent.py",
             "    return 256 * torch.finfo(kth.dtype).eps * kth.abs()", "    return torch.zeros_like(kth)",
             ("tests/engine/test_own_attention.py::test_random_trees_and_plans",),
             "keys tied in exact arithmetic but a rounding unit apart are chosen by the computation's shapes: Doge's "
             "DfsEngine gradient off by 0.16"),
    Mutation("images-merged-by-placeholder-tokens", "src/treerl/tree/sequence.py",
             "        if not self.images:\n            return self.tokens", "        if True:\n            return self.tokens",
             ("tests/tree/test_image_spans.py",),
             "two prompts with different images of one size are merged into one node: one sample's image is lost"),
    Mutation("images-fed-as-text", "src/treerl/engine/base.py",
             "    check_images(model, sequences)\n", "",
             ("tests/engine/test_images.py::test_images_a_model_cannot_take_are_refused_before_compute",),
             "a batch that shows images trains a vision-language model on its placeholder tokens without the pixels"),
    Mutation("vision-gradient-not-sent-back", "src/treerl/engine/dfs.py",
             "            walk.images.backward()", "            pass",
             ("tests/engine/test_images.py::test_images_in_shared_prompts_and_agent_turns_are_exact",),
             "the vision tower never learns: what the units sent to the image rows stays on the leaf"),
    Mutation("image-positions-as-depth", "src/treerl/engine/dfs.py",
             "            inputs[\"position_ids\"] = body_positions(data.rope, ids.shape)",
             "            inputs[\"position_ids\"] = body_positions(data.rope[: ids.numel()].repeat(data.rope.numel() // "
             "ids.numel()), ids.shape)",
             ("tests/engine/test_images.py::test_images_in_shared_prompts_and_agent_turns_are_exact",),
             "image tokens and the text after them rotated by their depth, not by Qwen-VL's (t, h, w) positions"),
    Mutation("image-rows-of-another-image", "src/treerl/engine/images.py",
             "        self.base[digest] = rows\n", "        self.base[digest] = 0\n",
             ("tests/engine/test_images.py::test_images_in_shared_prompts_and_agent_turns_are_exact",),
             "every image reads the first image's embeddings"),
    Mutation("deepstack-features-dropped", "src/treerl/engine/images.py",
             "        if len(self.leaves) > 1:\n", "        if False:\n",
             ("tests/engine/test_images.py::test_images_in_shared_prompts_and_agent_turns_are_exact",),
             "Qwen3-VL's DeepStack features never reach the text body's first layers in the tree"),
    Mutation("vision-graph-held-through-the-walk", "src/treerl/engine/images.py",
             "        with torch.set_grad_enabled(attached and trains):\n            main, deep = family.features(model, self.images)\n"
             "        self.leaves = [torch.cat(main)] + [torch.cat(layer) for layer in deep]\n",
             "        with torch.set_grad_enabled(trains):\n            main, deep = family.features(model, self.images)\n"
             "        self.held = [torch.cat(main)] + [torch.cat(layer) for layer in deep]\n"
             "        self.leaves = [h.detach() for h in self.held]\n",
             ("tests/engine/test_images.py::test_measured_peak_within_the_flat_references_with_images",),
             "the walk holds the vision graph of every distinct image of the step: more than flat's call on one sequence"),
    Mutation("sampler-image-prompt-at-its-depth", "src/treerl/rollout/embedded.py",
             "positions[:, row, width - len(shown) :] = where",
             "positions[:, row, width - len(shown) :] = torch.arange(len(shown))",
             ("tests/rollout/test_embedded_images.py",),
             "the embedded sampler rotates an image prompt by depth, not by the positions the engines train it at: "
             "behaviour log-probs off-policy"),
    Mutation("image-token-the-policy-wrote-placed-as-an-image", "src/treerl/engine/images.py",
             "types = image_token_types(sequence)[None].to(ids.device)",
             "types = (ids == model.config.image_token_id).int()",
             ("tests/engine/test_images.py::test_an_image_token_the_policy_wrote_is_text_as_it_was_sampled",
              "tests/rollout/test_prompt_images.py"),
             "an image token a sampled reply holds is placed as an image: the step fails (or trains other positions "
             "than the sampler decoded)"),
    Mutation("prompt-image-at-the-template-token", "src/treerl/rollout/images.py",
             "spans.append(processor.span(image, offset + len(out)))",
             "spans.append(processor.span(image, offset + where))",
             ("tests/rollout/test_prompt_images.py",),
             "a prompt's second image is placed where the template wrote its token, before the first one's expansion"),
    Mutation("sft-later-screenshot-placed-from-zero", "src/treerl/trainer/sft/data.py",
             "chat.continuation_with_images(pending, offset=len(tokens), who=where)",
             "chat.continuation_with_images(pending, who=where)",
             ("tests/trainer/test_sft_loop.py::test_sft_on_conversations_that_show_images",),
             "an SFT conversation's later screenshot is placed as if the conversation started at its tool message"),
    Mutation("sft-keeps-stand-ins-for-images", "src/treerl/trainer/sft/data.py",
             "        if not image_parts([m for path in conversation.paths for m in path]):",
             "        if True:",
             ("tests/trainer/test_sft_loop.py::test_sft_on_conversations_that_show_images",),
             "an SFT conversation that shows images is trained on pixel-less stand-ins"),
    Mutation("gemma3-flat-image-causal", "src/treerl/engine/flat.py",
             "            if family.both_ways:  # an image's tokens see each other both ways: the model's own mask",
             "            if False:",
             ("tests/engine/test_images.py::test_gemma3s_images_attend_both_ways_in_every_plan",),
             "the flat reference trains Gemma 3's image tokens causally: not the model's own function"),
    Mutation("gemma3-sampler-prefill-causal", "src/treerl/rollout/embedded.py",
             "        if family.both_ways:  # an image's tokens see each other both ways (Gemma 3): the model's own masks",
             "        if False:",
             ("tests/engine/test_images.py::test_gemma3s_sampler_prefills_images_both_ways_as_the_flat_reference_trains_them",),
             "the sampler prefills Gemma 3's image prompts causally: behaviour log-probs off-policy"),
    Mutation("async-worker-drops-images", "src/treerl/trainer/asynchronous/workers.py",
             "                              images=tuple(ImageSpan(", "                              images=() and (ImageSpan(",
             ("tests/trainer/test_async.py::test_a_rollout_workers_sequences_reach_the_trainer_with_their_images",),
             "an asynchronous run trains image placeholder tokens without their pixels"),
    # ------------------------------------------------------------------ trainer (issue 26's three survivors)
    Mutation("staleness-off-by-one", "src/treerl/trainer/asynchronous/pool.py",
             "if version - g.oldest > self.max_staleness]", "if version - g.oldest > self.max_staleness + 1]",
             ("tests/trainer/test_async.py::test_a_group_is_trained_at_max_staleness_versions_old_and_dropped_later",),
             "a group one version staler than max_staleness is trained"),
    Mutation("checkpoint-deleted-before-rename", "src/treerl/trainer/core/checkpoint.py",
             "        os.replace(path, trash)\n    os.replace(tmp, path)",
             "        shutil.rmtree(path)\n    os.replace(tmp, path)",
             ("tests/trainer/test_checkpoint.py",),
             "a kill between deleting a step's previous checkpoint and renaming the new one leaves neither"),
    Mutation("resume-model-path-mutable", "src/treerl/trainer/core/resume.py",
             'IMMUTABLE = ("model.path", ', "IMMUTABLE = (",
             ("tests/trainer/test_checkpoint.py::test_a_refused_resume_writes_nothing",),
             "resuming on another model.path of the same architecture silently loads the checkpoint into it"),
    Mutation("resume-loop-state-dropped", "src/treerl/trainer/core/run.py",
             "        self.loop_state.update(saved)\n", "",
             ("tests/trainer/test_rl.py::test_the_skipped_step_count_goes_on_after_a_resume",),
             "a resumed run counts its skipped steps, and prices its batches, as if it had just started"),
    # ------------------------------------------------------------------ the memory contract (issue 24)
    Mutation("contract-twice-flats-micro-batch", "src/treerl/engine/memory.py",
             "else micro_batch * per_token  # what flat holds", "else 2 * micro_batch * per_token  # what flat holds",
             ("tests/engine/test_memory.py",),
             "the default DfsEngine holds up to twice what flat training of the same max_tokens would"),
    Mutation("contract-path-store-uncounted", "src/treerl/engine/memory.py",
             "tokens = (budget - -(-longest_path // path_ranks) * path_bytes_per_token(model)) // held",
             "tokens = budget // held",
             ("tests/engine/test_memory.py",),
             "the path's keys and values are left out of the budget: a long path goes over flat's micro-batch"),
    Mutation("one-path-mode-ignored", "src/treerl/engine/memory.py",
             'if budget_bytes is None and memory == "one-path":', 'if budget_bytes is None and memory == "one path":',
             ("tests/engine/test_memory.py",),
             'memory="one-path" silently runs with the default contract (up to flat\'s micro-batch)'),
    Mutation("contract-hybrid-packed-micro-batch", "src/treerl/engine/dfs.py",
             "        if runs_in_rows(model) or any(s.images for s in tree.sequences):\n            # flat cannot pack",
             "        if False:\n            # flat cannot pack",
             ("tests/engine/test_memory.py",),
             "a hybrid's contract is flat's packed micro-batch, which flat cannot form for it: 2x one sequence held"),
    Mutation("contract-row-padding-uncounted", "src/treerl/engine/memory.py",
             "        if not self.padded:\n            return width", "        if True:\n            return width",
             ("tests/engine/test_memory.py::test_a_hybrids_peak_within_flats_one_sequence_micro_batch",),
             "a hybrid's short rows are counted without the chunk padding its mixers hold: a trie of short nodes "
             "holds 1.2x flat's micro-batch"),
    # ------------------------------------------------------------------ the recurrent state's hand-off (issue 23)
    Mutation("state-gradient-dropped", "src/treerl/engine/recurrent.py",
             "        if leaves is None or not self.with_grads:\n            return\n        grads = self.grads[-1]",
             "        if True:\n            return\n        grads = self.grads[-1]",
             ("tests/engine/test_recurrent.py::test_every_plan_carries_the_state_exactly",),
             "a child's gradient with respect to the state it started from never reaches its parent"),
    Mutation("state-not-handed-on", "src/treerl/engine/recurrent.py",
             "        if self.initial is None or key not in self.initial:\n            return None",
             "        if True:\n            return None",
             ("tests/engine/test_recurrent.py::test_every_plan_carries_the_state_exactly",),
             "a node starts from a zero state instead of its parent's final one"),
    Mutation("cache-under-an-ignored-name", "src/treerl/engine/recurrent.py",
             'for name in ("cache", "past_key_values", "cache_params")', 'for name in ("past_key_values", "cache_params")',
             ("tests/engine/test_recurrent.py::test_every_hybrid_family_in_every_plan",),
             "pure Mamba2 (transformers 5.24 takes `cache`) gets its cache under a name it ignores: refused"),
    Mutation("indexer-keys-of-another-layer", "src/treerl/engine/recurrent.py",
             "past = self.index_path.read(layer_idx, self.past)", "past = self.index_path.read(0, self.past)",
             ("tests/engine/test_recurrent.py::test_sparse_attention_chooses_each_querys_keys_among_its_ancestors",),
             "every layer's indexer ranks the path's tokens by the first layer's indexer keys: once the top-k binds, "
             "a query's keys are chosen over the wrong key set"),
    Mutation("index-ties-by-call-width", "src/treerl/engine/recurrent.py",
             "if layer_idx in self.index_path.whole_row_topk else keys", "if False else keys",
             ("tests/engine/test_recurrent.py::test_sparse_attention_chooses_each_querys_keys_among_its_ancestors",),
             "of keys tied at the k-th index score, torch.topk on CPU picks by the width of the call: DfsEngine's "
             "sparse attention changes with its plan and differs from one flat call's"),
    Mutation("sparse-attention-sinks-dropped", "src/treerl/attention/tree_attention.py",
             "    if layer.sinks is not None:  # a learned logit that", "    if False:  # a learned logit that",
             ("tests/engine/test_recurrent.py::test_sparse_attention_chooses_each_querys_keys_among_its_ancestors",),
             "HY-V4's attention sinks are left out of its sparse attention's softmax: every weight too large"),
    Mutation("sparse-attention-sink-sign", "src/treerl/attention/tree_attention.py",
             "per_query = sinks.view(1, heads, 1, 1) if", "per_query = -sinks.view(1, heads, 1, 1) if",
             ("tests/engine/test_recurrent.py::test_sparse_attention_chooses_each_querys_keys_among_its_ancestors",),
             "a sink's logit enters the sparse softmax negated (invisible at HY-V4's init of 0)"),
    Mutation("sparse-attention-window-ignored", "src/treerl/attention/tree_attention.py",
             "        _check_sparse_spec(layer.spec, index)\n    else:", "        pass\n    else:",
             ("tests/engine/test_recurrent.py::test_sparse_attention_refuses_a_window_or_soft_cap",),
             "a sparse-attention layer's sliding window or soft-cap is silently dropped"),
    Mutation("index-ties-by-call-width-renamed-indexers", "src/treerl/engine/recurrent.py",
             "WHOLE_ROW_TOPK_INDEXERS = (*_DSA_INDEXERS, ", "WHOLE_ROW_TOPK_INDEXERS = (*_DSA_INDEXERS[:2], ",
             ("tests/engine/test_recurrent.py::test_sparse_attention_chooses_each_querys_keys_among_its_ancestors",),
             "the DeepSeek indexer under another class name (A.X K2, dots3-note, HY-V4) picks among keys tied at the "
             "k-th score by the width of the call: DfsEngine's choice differs from one flat call's"),
    Mutation("flat-index-ties-by-call-width", "src/treerl/engine/flat.py",
             "contextlib.nullcontext(), earliest_index_ties(model):",
             "contextlib.nullcontext(), contextlib.nullcontext():",
             ("tests/engine/test_recurrent.py::test_sparse_attention_chooses_each_querys_keys_among_its_ancestors",
              ("tests/engine/test_recurrent.py::"
               "test_the_models_own_cpu_forward_differs_from_the_engines_only_after_a_tied_index_score")),
             "FlatEngine runs the model's own CPU top-k, which picks among keys tied at the k-th index score by the "
             "width of the call: the flat reference and DfsEngine disagree on a sequence with such a tie"),
    Mutation("position-bias-dropped", "src/treerl/attention/tree_attention.py",
             "    if layer.bias is not None:  # a bias per query and key", "    if False:  # a bias per query and key",
             ("tests/engine/test_recurrent.py::test_a_bias_over_distances_reads_the_path_at_its_distances",),
             "Inkling's position_bias over query-key distances is left out of DfsEngine's attention"),
    Mutation("dense-attention-window-ignored", "src/treerl/attention/tree_attention.py",
             "    if layer.spec.window is not None:  # key k visible", "    if False:  # key k visible",
             ("tests/engine/test_recurrent.py::test_a_bias_over_distances_reads_the_path_at_its_distances",),
             "an Inkling sliding-window layer's queries see every earlier key of the path, not the last 8"),
    # ---- DeepSeek-V4's compressed attention
    Mutation("compressed-entries-not-handed-on", "src/treerl/engine/recurrent.py",
             "entries = compressed if start is None else torch.cat(", "entries = compressed if True else torch.cat(",
             ("tests/engine/test_recurrent.py::test_compressed_attention_continues_the_paths_windows",),
             "a DeepSeek-V4 node's queries see only the compressed entries of its own windows, not the path's"),
    Mutation("compressed-open-window-dropped", "src/treerl/engine/recurrent.py",
             "        return new if start is None else torch.cat([start.to(new.dtype), new], dim=1)",
             "        return new",
             ("tests/engine/test_recurrent.py::test_compressed_attention_continues_the_paths_windows",),
             "the window a DeepSeek-V4 node's parent left open is compressed from the node's tokens alone"),
    Mutation("compressed-overlap-not-handed-on", "src/treerl/engine/recurrent.py",
             "        return prior\n", "        return None, None\n",
             ("tests/engine/test_recurrent.py::test_compressed_attention_continues_the_paths_windows",),
             "a DeepSeek-V4 node's first compressed-sparse entry misses the previous window's overlap slice"),
    Mutation("compressed-window-positions-from-zero", "src/treerl/engine/recurrent.py",
             "return kv[:, :usable], gate[:, :usable], self.cache.past // self.rate * self.rate",
             "return kv[:, :usable], gate[:, :usable], 0",
             ("tests/engine/test_recurrent.py::test_compressed_attention_continues_the_paths_windows",),
             "a DeepSeek-V4 node's compressed entries are rotated as if its windows began at position 0"),
    Mutation("compressed-entries-bias-dropped", "src/treerl/attention/tree_attention.py",
             "        if layer.appended_bias is not None:\n            more = ",
             "        if False:\n            more = ",
             ("tests/engine/test_recurrent.py::test_compressed_attention_continues_the_paths_windows",),
             "a DeepSeek-V4 query reads every compressed entry of its row: later windows', and those its indexer "
             "left out"),
    Mutation("compressed-index-ties-by-call-width", "src/treerl/engine/recurrent.py",
             'if name == "indexer" else entries', "if False else entries",
             ("tests/engine/test_recurrent.py::test_compressed_attention_continues_the_paths_windows",),
             "DeepSeek-V4's indexer picks among entries tied at the k-th score by the width of the call in DfsEngine"),
    # ---- Mamba's selective scan continued from the parent's state (issue 32)
    Mutation("scan-parent-state-not-added", "src/treerl/engine/selective_scan.py",
             "    outputs, state = [], start\n", "    outputs, state = [], None\n",
             ("tests/engine/test_recurrent.py::test_the_selective_scan_continues_the_parents_state",),
             "a Mamba node's scan starts from zero (transformers' scan) instead of adding its parent's SSM state"),
    Mutation("scan-chunk-state-not-carried", "src/treerl/engine/selective_scan.py",
             "output, state = _checkpointed(original, state, A,", "output, state = _checkpointed(original, start, A,",
             ("tests/engine/test_recurrent.py::test_the_selective_scan_continues_the_parents_state",),
             "every chunk of a long Mamba node's scan restarts from the parent's state, not the previous chunk's"),
    Mutation("scan-carried-state-ungated", "src/treerl/engine/selective_scan.py",
             "        read = read * F.silu(z)\n", "        read = read * 1.0\n",
             ("tests/engine/test_recurrent.py::test_the_selective_scan_continues_the_parents_state",),
             "the carried state's read-out is added without the layer's gate silu(z)"),
    Mutation("scan-state-handed-to-the-layer", "src/treerl/engine/recurrent.py",
             "        if layer_idx in self.scan_layers:\n            selective_scan.hand(ScanStart(",
             "        if False:\n            selective_scan.hand(ScanStart(",
             ("tests/engine/test_recurrent.py::test_the_selective_scan_continues_the_parents_state",),
             "a Mamba layer gets its parent's state itself: its multi-token scan starts from zero whatever it holds"),
    Mutation("attention-second-call-shares-slot", "src/treerl/attention/tree_attention.py",
             "        self.calls[index] = n + 1\n        return index, n\n",
             "        self.calls[index] = n + 1\n        return index, 0\n",
             ("tests/engine/test_model_features.py::test_a_layer_that_attends_more_than_once_has_a_path_slot_per_call",),
             "a second attention call of a layer (DiffLlama, Dory's loop, HRM's cycles) shares the first call's K/V slot "
             "on the path: its queries see the other call's ancestor keys"),
    Mutation("repeated-attention-replayed-unrefused", "src/treerl/attention/tree_attention.py",
             "        if n and self.replays:\n", "        if False:\n",
             (("tests/engine/test_model_features.py::"
               "test_gradient_checkpointing_of_a_layer_that_attends_twice_is_refused"),),
             "gradient checkpointing replays a layer that attends twice with its first call's K/V slot for both"),
    Mutation("attention-around-a-mixer-unchecked", "src/treerl/engine/support.py",
             "return not inside and (not around or is_attention(module))", "return not inside and not around",
             ("tests/engine/test_recurrent.py::test_an_attention_layer_holding_a_mixer_is_still_checked_for_routing",),
             "an attention module with a token mixer inside it is dropped from the all-layers-routed check: when it "
             "computes its attention without treerl, its queries silently miss the path's keys"),
    # ---- refusals name the real obstacle (issue 32)
    Mutation("stateful-names-case-sensitive", "src/treerl/engine/recurrent.py",
             "                       re.IGNORECASE)", "                       0)",
             ("tests/engine/test_recurrent.py::test_a_mixer_the_table_does_not_know_is_refused_naming_the_layer",),
             'a module named for its state in another case ("Rwkv" for "RWKV") goes unseen: the model is refused for '
             "something else, or trained with the state running from one node into the next"),
    Mutation("the-body-named-as-the-mixer", "src/treerl/engine/recurrent.py",
             "if path and _looks_stateful(module) and not inside_or_around:",
             "if _looks_stateful(module) and not inside_or_around:",
             ("tests/engine/test_recurrent.py::test_a_mixer_the_table_does_not_know_is_refused_naming_the_layer",),
             "a model body named for its family's recurrence (RecurrentGemmaModel) is named as the mixer to blame"),
    Mutation("positions-blamed-before-routing", "src/treerl/engine/base.py",
             "    check_routed(model, mixers)  # before positions: MPT (ALiBi) computes attention in its own code\n"
             "    check_layer_indices(model)\n",
             "    check_layer_indices(model)\n",
             ("tests/engine/test_refusals.py::test_a_refusal_names_the_obstacle_the_model_has",),
             "Bloom and MPT are refused for position_ids, which their relative ALiBi does not need, not served for the "
             "attention they compute in their own code"),
    Mutation("idle-module-run-unchecked", "src/treerl/engine/base.py", "        if idle_ran:\n", "        if False:\n",
             ("tests/engine/test_refusals.py::test_a_module_taken_for_idle_in_a_text_batch_that_runs_is_refused",),
             "a module listed as idle in a text batch runs after all, unrouted: its attention misses the path"),
    Mutation("attention-wrapper-flagged", "src/treerl/engine/support.py",
             "               and not any(i.startswith(path + \".\") for i in indexed)]", "               ]",
             ("tests/engine/test_refusals.py::test_a_module_that_is_no_obstacle_refuses_nothing",),
             "an attention wrapper (BertGenerationAttention) is refused for a layer_idx the attention inside it holds"),
    Mutation("image-cross-attention-not-idle", "src/treerl/engine/support.py",
             '    "MllamaCrossAttentionDecoderLayer": ', '    "MllamaCrossAttentionDecoderLayerX": ',
             ("tests/engine/test_refusals.py::test_a_module_that_is_no_obstacle_refuses_nothing",),
             "Mllama is refused for image cross-attention layers a text-only batch never runs"),
    # ------------------------------------------------------------------ the DFS walk's plan
    Mutation("plan-keep-without-room", "src/treerl/tree/plan.py",
             "return [True, False] if fits else [False]", "return [True, False]",
             ("tests/tree/test_plan.py",),
             "a kept graph leaves no room for the node below it: the walk holds more than its memory budget"),
    Mutation("plan-room-below-a-kept-unit", "src/treerl/tree/plan.py",
             "room - unit.tokens if unit.keep else room, unit.below[o]", "room, unit.below[o]",
             ("tests/tree/test_plan.py",),
             "units below a kept graph are planned as if it held nothing: over the memory budget"),
    Mutation("plan-call-size-ignored", "src/treerl/tree/plan.py",
             "        room = min(room, self.unit_tokens)\n", "",
             ("tests/tree/test_plan.py",),
             "batch_tokens (the most rows of one call) is not honoured"),
    Mutation("plan-budget-below-the-largest-node", "src/treerl/tree/plan.py",
             "self.capacity = max(capacity, max(map(row_tokens, run[1:]), default=0))", "self.capacity = capacity",
             ("tests/tree/test_plan.py",),
             "a budget smaller than the largest node is reported as held while the walk exceeds it"),
    Mutation("plan-chain-misses-its-top", "src/treerl/tree/plan.py",
             "        while node != unit.parent:\n            out.append(node)",
             "        while self.tree.nodes[node].parent != unit.parent:\n            out.append(node)",
             ("tests/tree/test_plan.py",),
             "the path store misses the top node of a unit: its descendants attend to the wrong keys"),
    Mutation("plan-cheapest-plan-not-taken", "src/treerl/tree/plan.py",
             "self.units = min(plans, key=lambda units: estimate(units, cost))", "self.units = plans[0]",
             ("tests/tree/test_plan.py",),
             "the walk runs the plain fill even where the cost model prices another plan lower"),
    Mutation("plan-recompute-cost-dropped", "src/treerl/tree/plan.py",
             "cost += self.cost.forward_call + self.cost.forward_token * tokens", "cost += self.cost.forward_call",
             ("tests/tree/test_plan.py",),
             "the planner prices a recomputation without its tokens and recomputes where keeping is cheaper"),
    Mutation("plan-never-mode-recomputes", "src/treerl/tree/plan.py",
             '        if self.recompute == "never":\n            return [True]\n', "",
             ("tests/tree/test_plan.py",), "recompute='never' still recomputes where the cost model prefers it"),
    # ------------------------------------------------------------------ losses, advantages, normaliser
    Mutation("loss-clip-higher-ignored", "src/treerl/algo/policy.py",
             "ratio.clamp(1.0 - clip_low, 1.0 + clip_high)", "ratio.clamp(1.0 - clip_low, 1.0 + clip_low)",
             ("tests/algo/test_losses.py",), "clip_eps_high (DAPO's clip-higher) has no effect"),
    Mutation("loss-clip-fraction-counts-ties", "src/treerl/algo/policy.py",
             "was_clipped = clipped > unclipped", "was_clipped = clipped >= unclipped",
             ("tests/algo/test_losses.py",), "clip_fraction reports every unclipped token as clipped"),
    Mutation("loss-dual-clip-on-positive-advantages", "src/treerl/algo/policy.py",
             "capped = (advantages < 0) & (loss > cap)", "capped = loss > cap",
             ("tests/algo/test_losses.py",), "dual clip caps the loss of good tokens too"),
    Mutation("loss-entropy-bonus-sign", "src/treerl/algo/loss.py",
             "token_loss = token_loss - config.entropy_coef * view.entropy",
             "token_loss = token_loss + config.entropy_coef * view.entropy",
             ("tests/algo/test_losses.py",), "entropy_coef > 0 lowers the entropy instead of raising it"),
    Mutation("loss-kl-term-dropped", "src/treerl/algo/loss.py",
             "token_loss = token_loss + config.kl_coef * kl", "token_loss = token_loss",
             ("tests/algo/test_losses.py",), "kl_coef is logged but never pulls the policy to the reference"),
    Mutation("loss-gspo-ratio-over-all-tokens", "src/treerl/algo/policy.py",
             "/ torch.where(trained > 0, trained, 1.0)", "/ len(mask)",
             ("tests/algo/test_losses.py",), "GSPO's sequence ratio averages over prompt tokens too"),
    Mutation("loss-importance-cap-inclusive", "src/treerl/algo/policy.py",
             "weight = torch.where(weight > cap, 0.0, weight)", "weight = torch.where(weight > cap + 0.1, 0.0, weight)",
             ("tests/algo/test_losses.py",), "tokens whose behaviour weight is above the cap are trained"),
    Mutation("loss-ratio-on-untrained-tokens", "src/treerl/algo/policy.py",
             "return torch.where(mask > 0, logp - other, 0.0)", "return logp - other",
             ("tests/algo/test_losses.py",),
             "an untrained token far from its old log-prob makes the loss or its gradient inf/NaN"),
    Mutation("loss-kl-twice-with-kl-in-reward", "src/treerl/algo/loss.py",
             "if config.kl_coef > 0 and not config.kl_in_reward:", "if config.kl_coef > 0:",
             ("tests/algo/test_losses.py",),
             "with kl_in_reward the KL penalty is applied in the reward and again in the loss"),
    Mutation("normalizer-counts-untrained-sequences", "src/treerl/algo/normalizer.py",
             "count += int(trained > 0)", "count += 1",
             ("tests/algo",), "sequences with no trained token shrink every sequence-mean loss"),
    Mutation("normalizer-seq-mean-over-all-tokens", "src/treerl/algo/normalizer.py",
             "return total / torch.where(trained > 0, trained, 1.0) / sequences",
             "return total / len(mask) / sequences",
             ("tests/algo",), "seq_mean_token_mean divides by the sequence's length, prompt included"),
    Mutation("normalizer-sum-drops-a-part", "src/treerl/algo/normalizer.py",
             "LossNormalizer(self.tokens + other.tokens, self.sequences + other.sequences)",
             "LossNormalizer(self.tokens + other.tokens, self.sequences)",
             ("tests/algo",), "data-parallel ranks' sequence counts are not added: sequence means too large"),
    Mutation("advantage-rloo-counts-itself", "src/treerl/algo/advantages.py",
             "out[members] = r - (r.sum() - r) / (len(members) - 1)", "out[members] = r - r.sum() / len(members)",
             ("tests/algo/test_advantages.py",), "RLOO's baseline includes the sample's own reward"),
    Mutation("advantage-std-biased", "src/treerl/algo/advantages.py",
             "centred / (r.std() + eps)", "centred / (r.std(unbiased=False) + eps)",
             ("tests/algo/test_advantages.py",), "GRPO's advantages scaled by the population std, not the sample std"),
    Mutation("advantage-turn-discount-ignored", "src/treerl/algo/advantages.py",
             "out[end - 1] = gamma * turn_discount", "out[end - 1] = gamma",
             ("tests/algo/test_advantages.py",), "turn_discount has no effect on multi-turn returns"),
    Mutation("advantage-whiten-over-untrained-tokens", "src/treerl/algo/advantages.py",
             "trained = torch.cat([a[m > 0] for a, m in zip(per_sequence, masks)])",
             "trained = torch.cat(per_sequence)",
             ("tests/algo/test_advantages.py",), "whitening statistics include prompt tokens (advantage 0)"),
    Mutation("advantage-trajectory-counted-per-call", "src/treerl/algo/advantages.py",
             'key = (group, seq.info.get("trajectory", ("sequence", i)))', 'key = (group, ("sequence", i))',
             ("tests/algo/test_advantages.py",), "a multi-turn episode weighs in its group's baseline once per call"),
    Mutation("advantage-group-of-one", "src/treerl/algo/advantages.py",
             "        if len(members) == 1:\n            continue\n", "",
             ("tests/algo/test_advantages.py",), "a prompt with one sample gets a NaN advantage (std of one value)"),
    # ------------------------------------------------------------------ the balancer
    Mutation("balance-budget-unchecked", "src/treerl/distributed/assign.py",
             "        if run.unique(start, j + 1) > budget:", "        if run.unique(start, j + 1) > 2 * budget:",
             ("tests/distributed/test_assign.py",), "the LPT baseline's micro-batches exceed micro_batch_tokens"),
    Mutation("balance-rank-budget-dropped", "src/treerl/distributed/assign.py",
             "cuts = run.micro_batches(0, len(positions), budget)", "cuts = run.micro_batches(0, len(positions), None)",
             ("tests/distributed/test_assign.py",), "a rank's micro-batches exceed micro_batch_tokens (out of memory)"),
    Mutation("balance-first-candidate-kept", "src/treerl/distributed/assign.py",
             "    best = min(names, key=lambda n: (max(priced[n]), sum(priced[n]), names.index(n)))",
             "    best = names[0]",
             ("tests/distributed/test_assign.py",),
             "the balancer keeps whole-tree LPT even where another plan is faster"),
    Mutation("balance-leaf-cost-dropped", "src/treerl/distributed/assign.py",
             " + self.leaf_weight * leaves", "",
             ("tests/distributed",), "the balancer's run prices ignore the per-leaf cost of the fitted model"),
    Mutation("balance-sequence-at-the-budget-refused", "src/treerl/distributed/assign.py",
             "if len(seq) > micro_batch_tokens:", "if len(seq) >= micro_batch_tokens:",
             ("tests/distributed/test_assign.py",), "a sequence exactly micro_batch_tokens long is refused"),
    Mutation("balance-keep-together-inverted", "src/treerl/distributed/assign.py",
             "if max(priced[names[0]]) <= max(priced[best]) * (1 + keep_together):",
             "if max(priced[names[0]]) >= max(priced[best]) * (1 + keep_together):",
             ("tests/distributed/test_assign.py",), "keep_together splits trees it should keep whole"),
    # ---- the end of a rank (gloo's abort at interpreter shutdown)
    Mutation("rank-exit-output-lost", "src/treerl/distributed/parallel.py",
             "    sys.stdout.flush()\n    sys.stderr.flush()\n", "    sys.stderr.flush()\n",
             ("tests/distributed/test_data_parallel.py::test_a_rank_exits_with_its_code_and_its_output_flushed",),
             "a rank's last printed lines (its final metrics) vanish when it ends without the interpreter's shutdown"),
    Mutation("rank-exit-code-lost", "src/treerl/distributed/parallel.py", "    os._exit(code)", "    os._exit(0)",
             ("tests/distributed/test_data_parallel.py::test_a_rank_exits_with_its_code_and_its_output_flushed",),
             "a rank stopped by a signal under torchrun exits 0, so torchrun reports a finished run"),
    # ---- agents and nothing silent (issue 25)
    Mutation("agent-system-exit-escapes", "src/treerl/rollout/agent.py",
             "    except (SystemExit, KeyboardInterrupt) as e:\n        raise AgentExited(e) from None",
             "    except KeyboardInterrupt as e:\n        raise AgentExited(e) from None",
             ("tests/rollout/test_agent.py::test_an_agent_that_exits_loses_its_episode_not_the_run",),
             "sys.exit() in an agent episode gets past the runner's `except Exception` and ends the run"),
    Mutation("max-failed-steps-never-reached", "src/treerl/trainer/rl/learn.py",
             "run.failed_steps.append((step, first_failure(batch.stats)))",
             "run.failed_steps = [(step, first_failure(batch.stats))]",
             ("tests/trainer/test_rl.py::test_a_run_whose_every_sample_keeps_failing_stops_naming_the_first_failure",),
             "a broken reward or agent drops every sample, step after step, and the run never stops"),
    Mutation("checkpoint-manifest-path-leaves", "src/treerl/trainer/core/checkpoint.py",
             "        file = inside(path, name)\n", "        file = path / name\n",
             ("tests/trainer/test_checkpoint.py::test_a_manifest_path_that_leaves_the_checkpoint_is_refused",),
             "a crafted manifest naming ../../a-file (or /a-file) has that file read and hashed, and the checkpoint "
             "accepted"),
    Mutation("agent-context-budget-ignored", "src/treerl/rollout/proxy.py",
             "if len(context.tokens) + budget > self.max_context_tokens:",
             "if len(context.tokens) > self.max_context_tokens:",
             ("tests/rollout/test_proxy.py::test_bad_requests_are_refused_with_the_reason",),
             "an agent's call whose prompt fits but prompt + max_tokens does not is sampled past "
             "rollout.max_context_tokens"),
    Mutation("parallel-tool-calls-dropped", "src/treerl/rollout/chat_api.py",
             "parallel_tool_calls=self.parallel_tool_calls is not False, n=self.n,", "n=self.n,",
             ("tests/rollout/test_proxy.py::test_parallel_tool_calls_false_returns_and_records_only_the_first_call",),
             "parallel_tool_calls=false is ignored: the agent gets (and the trainer trains) several calls per reply"),
    Mutation("responses-parallel-tool-calls-dropped", "src/treerl/rollout/responses_api.py",
             "parallel_tool_calls=self.parallel_tool_calls is not False,\n", "\n",
             ("tests/rollout/test_proxy.py::test_parallel_tool_calls_false_returns_and_records_only_the_first_call",),
             "the Responses API ignores parallel_tool_calls=false: several function_call items per reply"),
    Mutation("tool-choice-required-unenforced", "src/treerl/rollout/proxy.py",
             'for a in answers) if request.tool_choice == "required" else 0',
             'for a in answers) if request.tool_choice == "function" else 0',
             ("tests/rollout/test_proxy.py::test_required_tool_choice_never_returns_a_reply_without_a_call",),
             'tool_choice="required" returns replies without a tool call'),
    Mutation("no-tool-parser-auto-missed", "src/treerl/rollout/proxy.py",
             'and self.parser_name == "none":', 'and self.tool_parser == "none":',
             (("tests/rollout/test_proxy.py::"
               "test_a_tool_call_no_parser_can_read_is_refused_naming_rollout_tool_parser"),),
             "rollout.tool_parser=auto on a template with no known format: a required tool call fails with a bare 422"),
    Mutation("tool-format-warning-silent", "src/treerl/rollout/collect.py",
             'or detect_tool_parser(chat_template) != "none":', 'or detect_tool_parser(chat_template) == "none":',
             (("tests/rollout/test_collect.py::"
               "test_an_agent_task_whose_template_has_no_tool_call_format_is_warned_about"),),
             "an agent run on a template with no known tool-call format starts without a word"),
    Mutation("server-checked-after-the-model", "src/treerl/trainer/rl/sync.py",
             "    client = connect_servers(config)  # before the model is built: an unreachable server is an error "
             "at once\n    run = Run.start(config, temperature=config.rollout.temperature)\n",
             "    run = Run.start(config, temperature=config.rollout.temperature)\n"
             "    client = connect_servers(config)\n",
             ("tests/cli/test_bad_inputs.py::test_bad_input_is_one_error_line_exit_2_and_nothing_written",),
             "an unreachable rollout.server_url is reported only after the model is loaded (or another error first)"),
    Mutation("reporter-writes-before-the-first-step", "src/treerl/trainer/core/reporter.py",
             "        if self._logger is None:\n            self._held.append(write)\n        else:\n"
             "            write(self._logger)",
             "        if self._logger is None:\n            self.open()\n        write(self._logger)",
             ("tests/cli/test_bad_inputs.py::test_a_run_that_fails_before_its_first_step_is_trained_writes_nothing",),
             "a run that fails while it sets up leaves a metrics.jsonl (or deletes the run it was to replace)"),
    Mutation("reward-bound-at-float-max", "src/treerl/rollout/rewards.py",
             "    if abs(value) > MAX_ABS_REWARD:", "    if abs(value) > 1e308:",
             ("tests/rollout/test_rewards.py::test_call_reward",
              "tests/trainer/test_rl.py::test_a_reward_too_large_to_train_on_drops_its_sample"),
             "a reward of 1e308 is trained on: the reward statistics overflow"),
    # ---- what is left of issue 31: nothing silent, nothing unpickled, kills at chosen points of a write
    Mutation("no-step-trained-exits-0", "src/treerl/trainer/rl/learn.py",
             "        check_some_step_trained(run, failing)\n", "",
             ("tests/trainer/test_rl.py::test_a_run_none_of_whose_steps_trained_exits_3_naming_why",),
             "a run whose every sample was dropped (every prompt over rollout.max_context_tokens) exits 0 with a NaN "
             "reward"),
    Mutation("pickled-weights-loaded", "src/treerl/models.py", "    check_no_pickled_weights(Path(path), key)\n", "",
             ("tests/cli/test_bad_inputs.py::test_bad_input_is_one_error_line_exit_2_and_nothing_written",),
             "a model.path whose weights are only pytorch_model.bin reaches torch.load: a traceback"),
    # ------------------------------------------------------------------ inference servers (issue 31)
    Mutation("one-seed-for-every-prompt", "src/treerl/rollout/client.py",
             "else prompt_seed(params.seed, p) for p in range(len(prompts))]",
             "else params.seed for p in range(len(prompts))]",
             ("tests/rollout/test_server.py::test_server_samples_equal_the_embedded_sampler",
              "tests/rollout/test_vllm.py::test_seeded_samples_are_independent_across_prompts_and_reproducible"),
             "sample j of every prompt of a call comes from the same random stream (vLLM: seed + j for every prompt)"),
    Mutation("token-versions-not-read", "src/treerl/rollout/client.py",
             "    if not spans:\n        return [version] * count\n",
             "    if not spans or True:\n        return [version] * count\n",
             ("tests/rollout/test_client.py",
              "tests/rollout/test_vllm.py::test_a_generation_in_flight_across_a_push_tags_each_token_with_its_weights"),
             "tokens a server sampled after a push are counted as the old version: staleness and lags are wrong"),
    Mutation("truncated-logprob-untruncated", "src/treerl/rollout/embedded.py",
             "    if params.truncates:\n        tempered = truncate_logits(",
             "    if params.truncates:\n        _ = truncate_logits(",
             ("tests/rollout/test_embedded.py",),
             "with top_p < 1 the behaviour log-prob is the untruncated one, not that of the distribution sampled from"),
    Mutation("servers-not-pushed-at-start", "src/treerl/trainer/core/servers.py",
             "        try:\n            sampler.sync()\n", "        try:\n            sampler.pushed = sampler.version\n",
             ("tests/trainer/test_servers.py",),
             "a resumed run samples its first step from whatever the servers hold (the base model after a restart)"),
    Mutation("server-failure-not-checkpointed", "src/treerl/trainer/rl/learn.py",
             "checkpoint {run.checkpoint(done)} ", "checkpoint {Path(run.config.trainer.output_dir) / 'checkpoints'} ",
             ("tests/trainer/test_servers.py",),
             "a server dying mid-run loses every step since the last scheduled checkpoint"),
    Mutation("evaluation-counted-in-the-unfinished-step", "src/treerl/trainer/rl/learn.py",
             "            done = step + 1\n            if done < config.trainer.steps and config.trainer.eval_every and "
             "done % config.trainer.eval_every == 0:\n                evaluate(run, evaluation, done, None)",
             "            if step + 1 < config.trainer.steps and config.trainer.eval_every and (step + 1) % "
             "config.trainer.eval_every == 0:\n                evaluate(run, evaluation, step + 1, None)\n"
             "            done = step + 1",
             ("tests/trainer/test_servers.py",),
             "a server failing in the evaluation after step s checkpoints s steps' name over s + 1 steps' weights"),
    Mutation("replaced-checkpoint-not-put-back", "src/treerl/trainer/core/checkpoint.py",
             "            os.replace(path, name)\n", "            shutil.rmtree(path)\n",
             ("tests/trainer/test_kill.py",),
             "a kill while a step's checkpoint is being replaced loses that step (its old copy is deleted at resume)"),
    # ------------------------------------------------------------------ vision-language policies under torchrun (issue 33)
    Mutation("ddp-unused-gradient-zero", "src/treerl/distributed/parallel.py",
             "            if not took:\n                parameter.grad = None", "            if not took:\n                pass",
             ("tests/distributed/test_data_parallel.py::test_a_vision_language_policy_trains_on_two_ranks_as_in_one_process",),
             "under DDP a parameter no call used (a vision tower on a text step) gets a zero gradient: weight decay moves it"),
    Mutation("learner-never-says-images", "src/treerl/trainer/core/learner.py",
             "gradient_step(images=any(s.images for s in minibatch))", "gradient_step()",
             ("tests/trainer/test_torchrun.py::test_the_gradient_sync_is_told_whether_a_minibatch_shows_images",),
             "under FSDP2 a step that shows images on one rank only hangs in the gradient sync (the tower's groups differ)"),
    Mutation("gemma3-image-cut-by-a-chunk", "src/treerl/engine/dfs.py",
             "whole_images=family is not None and family.both_ways)", "whole_images=False)",
             ("tests/engine/test_images.py::test_gemma3s_images_attend_both_ways_in_every_plan",),
             "a long node's chunk cuts a Gemma 3 image: its first tokens never see its last ones"),
    Mutation("gemma3-later-keys-include-the-query", "src/treerl/attention/kernels.py",
             "            allowed = k > q\n", "            allowed = k >= q\n",
             ("tests/engine/test_images.py::test_gemma3s_images_attend_both_ways_in_every_plan",),
             "an image token attends to itself twice in Gemma 3's both-ways blocks"),
    # ------------------------------------------------------------------ context parallelism (issue 34)
    Mutation("cp-earlier-keys-of-a-run-dropped", "src/treerl/attention/context_parallel.py",
             "            if a > s.row:\n", "            if False:\n",
             ("tests/engine/test_context_parallel.py",),
             "a rank's queries in the middle of a causal run do not see the run's keys other ranks hold"),
    Mutation("cp-key-gradients-not-summed", "src/treerl/attention/context_parallel.py",
             "    dist.reduce_scatter_single(mine, torch.cat(pieces).contiguous(), group=shard.cp.group)\n",
             "    mine = pieces[shard.cp.rank]\n",
             ("tests/engine/test_context_parallel.py",),
             "a key's gradient from other ranks' queries never reaches the rank that computed the key"),
    Mutation("cp-state-not-passed-on", "src/treerl/engine/state_passing.py",
             "        self.cache.initial.update(zip(keys, received))\n", "        pass\n",
             ("tests/engine/test_context_parallel.py",),
             "a hybrid's mixer layers start each rank's piece of a row from a zero state, not the previous rank's"),
    Mutation("cp-state-gradient-not-sent-back", "src/treerl/engine/state_passing.py",
             "        ctx.passing.send_grads(grads)\n",
             "        ctx.passing.send_grads(tuple(torch.zeros_like(g) for g in grads))\n",
             ("tests/engine/test_context_parallel.py",),
             "the gradient of the state a rank's piece started from never reaches the rank that computed it"),
    Mutation("cp-plans-not-agreed", "src/treerl/engine/dfs.py",
             "            agree_graph_bytes(model, lambda values: cp.largest(values, _device(model)), self._side_by_side(model))\n",
             "",
             ("tests/engine/test_context_parallel.py::test_ranks_that_measure_different_graph_bytes_walk_one_plan",),
             "context-parallel ranks that measure a few bytes apart plan different units and exchange mismatched data"),
    Mutation("cp-budget-of-one-rank", "src/treerl/engine/dfs.py",
             "*((cp.size, cp.path_ranks, self._side_by_side(model)) if cp",
             "*((1, cp.path_ranks, self._side_by_side(model)) if cp",
             ("tests/engine/test_context_parallel.py::test_each_rank_holds_its_share_of_a_call_so_the_walk_packs_larger_calls",),
             "context-parallel ranks plan calls as if each held the whole call: R times more calls than memory needs"),
    Mutation("cp-path-partials-weighed-apart", "src/treerl/attention/context_parallel.py",
             "    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.cp.group)\n", "",
             ("tests/engine/test_context_parallel.py",),
             "each rank weighs its share of the path's attention by its own largest score: a wrong softmax"),
    Mutation("cp-path-gradient-dropped", "src/treerl/attention/tree_attention.py",
             "        path.add_ancestor_grads(ctx.layer, ctx.lo, layout.path_end, dk_p, dv_p)\n", "",
             ("tests/engine/test_context_parallel.py",),
             "the gradient of the path's K/V that a rank holds never reaches the ancestors that computed them"),
    Mutation("cp-path-stride-ignored", "src/treerl/attention/tree_attention.py",
             "q_max=layout.last_position, k_stride=path.ranks)", "q_max=layout.last_position)",
             ("tests/engine/test_context_parallel.py",),
             "a rank's share of the path is masked as if its keys were consecutive: windows cut the wrong keys"),
    Mutation("path-shard-rows-misplaced", "src/treerl/attention/tree_attention.py",
             "        row = s.row + first - s.position\n", "        row = s.row\n",
             ("tests/attention/test_path_store.py",),
             "a rank stores the K/V of the wrong rows at the path positions it holds"),
    Mutation("cp-short-sequences-never-trained", "src/treerl/trainer/core/learner.py",
             "            runs += [(self.engine_alone, batch, 1) for batch in split.alone[self.balancer.context_rank]]\n",
             "",
             ("tests/trainer/test_torchrun.py::test_context_parallel_ranks_end_with_the_single_process_parameters_and_metrics",),
             "under trainer.context_parallel_min_tokens the sequences each rank should train alone are dropped"),
    Mutation("cp-alone-fields-not-shared", "src/treerl/trainer/rl/learn.py",
             "    filled = [i for _, indices in parts for i in indices]\n",
             "    filled = parts[0][1]\n",
             ("tests/trainer/test_torchrun.py::test_context_parallel_ranks_end_with_the_single_process_parameters_and_metrics",),
             "the log-probs a rank recomputed for the sequences it trains alone never reach its context-parallel peers"),
    Mutation("cp-path-store-of-one-rank", "src/treerl/engine/dfs.py",
             "*((cp.size, cp.path_ranks, self._side_by_side(model)) if cp",
             "*((cp.size, 1, self._side_by_side(model)) if cp",
             ("tests/engine/test_context_parallel.py::test_each_rank_holds_its_share_of_a_call_so_the_walk_packs_larger_calls",),
             "a sharded path is budgeted as if each rank held it whole: fewer tokens a call than memory allows"),
    Mutation("side-by-side-read-dropped", "src/treerl/engine/parallel_scan.py",
             "            out = self.out + _read(self.read, start.to(self.read.dtype), self.layout)",
             "            out = self.out",
             ("tests/engine/test_parallel_scan.py::test_pieces_from_zero_corrected_by_their_transfers_are_the_whole_scan",
              "tests/engine/test_context_parallel.py::test_context_parallel_ranks_compute_the_flat_references_logprobs_and_gradients"),
             "a rank's piece of a split scan ignores the state the earlier pieces end in: its outputs start from zero"),
    Mutation("side-by-side-chain-skips-a-rank", "src/treerl/engine/parallel_scan.py",
             "    for r in range(1, pieces.rank):", "    for r in range(2, pieces.rank):",
             ("tests/engine/test_context_parallel.py::test_context_parallel_ranks_compute_the_flat_references_logprobs_and_gradients",),
             "on 3 ranks or more a piece's start skips rank 1's piece: wrong from rank 2 on"),
    Mutation("side-by-side-transfer-transposed", "src/treerl/engine/parallel_scan.py",
             '        return torch.einsum("bhkj,bhjv->bhkv", transfer, state)',
             '        return torch.einsum("bhjk,bhjv->bhkv", transfer, state)',
             ("tests/engine/test_parallel_scan.py::test_pieces_from_zero_corrected_by_their_transfers_are_the_whole_scan",),
             "the delta rule's transfer applied transposed: the carried state is wrong"),
    Mutation("side-by-side-selective-uncorrected", "src/treerl/engine/selective_scan.py",
             "    return output + read, state + carried", "    return output, state + carried",
             ("tests/engine/test_context_parallel.py::test_context_parallel_ranks_compute_the_flat_references_logprobs_and_gradients",),
             "Mamba's selective scan on a rank after the first reads nothing of the earlier pieces' state"),
    Mutation("side-by-side-window-not-sent", "src/treerl/engine/recurrent.py",
             "            start = self.neighbours.receive_window(key)",
             "            start = (self.neighbours.receive_window(key), None)[1]",
             ("tests/engine/test_context_parallel.py::test_context_parallel_ranks_compute_the_flat_references_logprobs_and_gradients",),
             "a rank's convolution starts from zeros, not the previous rank's window"),
    Mutation("side-by-side-budget-of-the-first-rank", "src/treerl/engine/memory.py",
             "        per_rank = per_token if side_by_side is None else max(per_token, graph_bytes(model, side_by_side).per_token)",
             "        per_rank = per_token",
             ("tests/engine/test_context_parallel.py::test_a_hybrid_whose_ranks_split_their_scans_budgets_what_a_later_rank_holds",),
             "a hybrid's ranks plan as if their pieces held the model's own graph: the ranks after the first, which scan "
             "with transfer columns, exceed the memory contract"),
    Mutation("cp-replay-without-the-call", "src/treerl/engine/state_passing.py",
             "        self.cache, self.shard, self.links, self.scanned = cache, shard, [], set()\n        try:",
             "        try:",
             ("tests/engine/test_context_parallel.py::test_context_parallel_ranks_compute_the_flat_references_logprobs_and_gradients",),
             "a hybrid's layers replayed by gradient checkpointing under context parallelism scan unsplit: the replay's "
             "tensors are not the forward's"),
    Mutation("checkpoint-names-not-mapped-back", "src/treerl/trainer/core/checkpoint.py",
             "    weights = model_names(model, read_weights(folder))", "    weights = read_weights(folder)",
             ("tests/cli/test_train_cmd.py::test_ppo_trains_a_critic_that_sees_the_images",),
             "a vision-language run cannot resume: its checkpoint holds the original layout's names"),
    Mutation("vl-critic-keeps-the-lm-head", "src/treerl/algo/critic.py",
             "    model.lm_head = None\n", "",
             ("tests/cli/test_train_cmd.py::test_ppo_trains_a_critic_that_sees_the_images",),
             "a vision-language critic holds a vocabulary-wide LM head it never reads"),
    # ------------------------------------------------------------------ memory and GPU (session 6)
    Mutation("unit-keeps-its-kv-with-history", "src/treerl/attention/tree_attention.py",
             "    return x.detach()\n", "    return x\n",
             ("tests/engine/test_memory.py::test_a_step_leaves_nothing_behind",),
             "flat's packed rows keep every micro-batch's K/V alive (a cycle through autograd's nodes): a GPU runs out "
             "of memory within a step, and a run loses that much every step"),
    Mutation("unit-grads-outside-the-budget", "src/treerl/engine/memory.py",
             "        held = per_token + unit_grad_bytes_per_token(model)", "        held = per_token",
             ("tests/engine/test_memory.py::test_measured_peak_within_the_contract",),
             "DfsEngine holds more than flat's packed micro-batch (its units' K/V gradient buffers unplanned): a user "
             "switching from flat needs more memory"),
    # ------------------------------------------------------------------ Gemma 3 rollouts (issue 33)
    Mutation("gemma3-pan-and-scan-ignored", "src/treerl/rollout/images.py",
             'return_tensors="pt", **self._pan_and_scan())', 'return_tensors="pt")',
             ("tests/rollout/test_gemma3_rollouts.py",),
             "a Gemma 3 checkpoint that asks for pan & scan samples without its crops: not the prompt it would see"),
    Mutation("gemma3-screenshot-placed-before-the-glue", "src/treerl/rollout/chat.py",
             "self.tokenizer, who, offset + len(head))", "self.tokenizer, who, offset)",
             ("tests/rollout/test_gemma3_rollouts.py",),
             "an agent's later screenshot on Gemma 3 is placed a token early: the tower's features land on the wrong rows"),
    Mutation("server-images-not-checked", "src/treerl/rollout/client.py",
             "        if images:\n            check_expanded(server, answer, prompt, images)\n", "",
             ("tests/rollout/test_vllm.py::test_a_server_that_expands_an_image_otherwise_is_stopped_with_the_reason",),
             "a server whose processor makes other placeholders of an image than the trainer's samples on, and the "
             "trainer trains those samples on other image rows than the server saw"),
    Mutation("server-images-sent-expanded", "src/treerl/rollout/client.py",
             '        body |= {"token_ids": collapsed(prompt, images), "return_token_ids": True,',
             '        body |= {"token_ids": prompt, "return_token_ids": True,',
             ("tests/rollout/test_vllm.py::test_image_prompts_sample_on_vllm_with_the_trainers_logprobs",),
             "vLLM expands every placeholder token of an image again: the server samples from a prompt with the "
             "image's tokens many times over"),
]


def applies(mutation: Mutation) -> str | None:
    """None if the mutation applies to the source as it is now and the result still compiles, else why not
    (a mutation that breaks the syntax would be "caught" by every test, and test nothing)."""
    file = ROOT / mutation.path
    if not file.is_file():
        return f"{mutation.path} does not exist"
    source = file.read_text()
    found = source.count(mutation.old)
    if found != 1:
        return f"its text occurs {found} times in {mutation.path} (must be once)"
    try:
        compile(source.replace(mutation.old, mutation.new), mutation.path, "exec")
    except SyntaxError as e:
        return f"the mutated {mutation.path} does not compile ({e.msg}, line {e.lineno})"
    return None


def run(mutation: Mutation) -> tuple[str | None, float]:
    """(the test that failed, None if none did; seconds): the tests run with the mutation in place; the file is
    written back whatever happens."""
    file = ROOT / mutation.path
    original = file.read_text()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.perf_counter()
    try:
        file.write_text(original.replace(mutation.old, mutation.new))
        result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                 *mutation.tests], check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        file.write_text(original)
    seconds = time.perf_counter() - started
    if result.returncode == 0:
        return None, seconds
    failed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return (failed[0] if failed else f"pytest exit code {result.returncode}"), seconds


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    unknown = set(argv) - {m.name for m in MUTATIONS} - {"--list"}
    if unknown:
        print(f"unknown mutations: {', '.join(sorted(unknown))} (see --list)")
        return 2
    if "--list" in argv:
        for m in MUTATIONS:
            print(f"{m.name:42} {m.path:42} {m.bug}")
        return 0
    broken = [f"{m.name}: {why}" for m in chosen if (why := applies(m))]
    if broken:
        print("mutations that no longer apply (update MUTATIONS):\n  " + "\n  ".join(broken))
        return 2
    survivors = []
    for m in chosen:
        failed, seconds = run(m)
        outcome = f"caught by {failed}" if failed else f"SURVIVED {' '.join(m.tests)}"
        print(f"{m.name:42} {seconds:4.0f} s  {outcome}", flush=True)
        if not failed:
            survivors.append(m)
    for m in survivors:
        print(f"survivor {m.name}: {m.bug} ({m.path})")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
