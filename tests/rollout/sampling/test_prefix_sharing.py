"""The embedded sampler's shared-prefix path (prefix sharing on, the default) against its padded path (each prompt
prefilled whole, the cache repeated n-fold: what it did before): with a seed, the same tokens and the same
log-probs (float64 to 1e-9, float32 to 1e-5) on random tries of prompts, with and without the prefix cache across
calls, for every layer kind it serves; the cache's bounds, its emptying at a weight update, and its counters."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import fresh_model, tiny_model

from treerl.rollout import EmbeddedSampler, Rollout, RolloutConfig, SamplingParams
from treerl.rollout.agents.proxy import ChatProxy
from treerl.rollout.sampling import prefix_sharing
from treerl.rollout.sampling.embedded import padded_refusal
from treerl.rollout.sampling.prefix_cache import PrefixCache
from treerl.rollout.sampling.prefix_sharing import SHARING_COST, refusal

VOCAB = 64


def assert_same(expected, got, tol: float = 1e-9) -> None:
    """Same tokens and finish reasons, log-probs within `tol`."""
    for group_a, group_b in zip(expected, got, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
            assert a.versions == b.versions
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) <= tol


def padded(model, prompts, params, **options):
    return EmbeddedSampler(model, prefix_sharing=False, **options).generate(prompts, params)


@st.composite
def tries(draw):
    """Prompts sharing prefixes of every length (0 included; whole prompts that prefix others; duplicates; one-token
    prompts), n 1-16, stop tokens that end some rows early, chunks of rows."""
    token = st.integers(8, VOCAB - 1)
    base = draw(st.lists(token, min_size=1, max_size=14))
    prompts = []
    for _ in range(draw(st.integers(1, 5))):
        shared = draw(st.integers(0, len(base)))
        tail = draw(st.lists(token, min_size=0 if shared else 1, max_size=6))
        prompts.append(base[:shared] + tail)
    if draw(st.booleans()):
        prompts.append(list(draw(st.sampled_from(prompts))))  # a duplicate
    n = draw(st.integers(1, 16))
    stop = tuple(draw(st.sets(st.integers(0, VOCAB - 1), min_size=0, max_size=10)))
    params = SamplingParams(n=n, max_new_tokens=draw(st.integers(1, 7)), stop_token_ids=stop,
                            seed=draw(st.integers(0, 2**31)), temperature=draw(st.sampled_from([1.0, 0.7])))
    return (prompts, params, draw(st.sampled_from([256, n, 2 * n + 1])), draw(st.sampled_from([0, 8, 256])),
            draw(st.sampled_from([4096, 3])))


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tries())
def test_random_tries_sample_what_the_padded_path_samples(case):
    """Without the cache, with it cold, and with it warm (every prompt's prefix computed by the call before); short
    shared stretches read in place or copied into their rows' own buffers (COPIED_TOKENS); prefill calls of at most
    3 tokens (PREFILL_TOKENS: long nodes as chains, a wave over several calls)."""
    prompts, params, max_rows, copied, prefill = case
    model = tiny_model("tiny-qwen3", vocab_size=VOCAB)
    expected = padded(model, prompts, params, max_rows=max_rows)
    with mock.patch.object(prefix_sharing, "COPIED_TOKENS", copied), \
            mock.patch.object(prefix_sharing, "PREFILL_TOKENS", prefill):
        uncached = EmbeddedSampler(model, max_rows=max_rows, prefix_cache_tokens=0, prefix_sharing="always")
        assert_same(expected, uncached.generate(prompts, params))
        cached = EmbeddedSampler(model, max_rows=max_rows)
        assert_same(expected, cached.generate(prompts, params))
        assert_same(expected, cached.generate(prompts, params))
    assert cached.counts.unshared_calls == cached.counts.padded_chunks == uncached.counts.padded_chunks == 0


def test_each_shared_prefix_is_prefilled_once_and_rows_leave_as_they_stop():
    """Prompts below one long shared prefix: the prefix runs once (the counters say so), and the decoding calls'
    rows shrink as rows stop."""
    model = tiny_model("tiny-qwen3", vocab_size=VOCAB)
    system = list(range(8, 40))
    prompts = [system + [50 + i, 60] for i in range(3)]
    assert refusal(model) is None  # its probe's calls before the hook
    body = model.model
    rows = []
    hook = body.register_forward_pre_hook(lambda m, a, kw: rows.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    sampler = EmbeddedSampler(model, prefix_cache_tokens=0, prefix_sharing="always")  # 32 shared tokens pay too little
    stop = tuple(range(0, VOCAB, 5))
    try:
        groups = sampler.generate(prompts, SamplingParams(n=4, max_new_tokens=6, stop_token_ids=stop, seed=3))
    finally:
        hook.remove()
    assert rows[:2] == [(1, len(system)), (1, 3 * 2)]  # the shared prefix, then the three prompts' own tokens
    assert sampler.counts.prefill_tokens == len(system) + 6 and sampler.counts.prompt_tokens == 3 * len(prompts[0])
    completions = [c for g in groups for c in g]
    assert [r[0] for r in rows[2:]] == [sum(len(c.tokens) > k for c in completions) for k in range(1, len(rows) - 1)]
    assert {c.finish_reason for c in completions} == {"stop", "length"}


def test_a_conversation_prefills_only_its_new_tokens_from_the_cache():
    """Turn 2's prompt extends turn 1's prompt and reply: only the reply's last token (no forward ran it) and the new
    tokens are prefilled; the samples are the padded path's."""
    model = tiny_model("tiny-qwen3", vocab_size=VOCAB)
    sampler = EmbeddedSampler(model)
    params = SamplingParams(n=1, max_new_tokens=5, seed=1)
    first = [10, 11, 12, 13, 14, 15]
    [[reply]] = sampler.generate([first], params)
    second = first + reply.tokens + [20, 21, 22]
    before = sampler.counts.prefill_tokens
    assert_same(padded(model, [second], params), sampler.generate([second], params))
    assert sampler.counts.prefill_tokens - before == 1 + 3
    assert sampler.counts.cached_tokens == len(first) + len(reply.tokens) - 1


def test_an_unread_call_stores_only_the_chunks_a_later_chunk_can_read():
    """Inside `unread()` (synchronous single-turn training: the cache is emptied after its one call) the last chunk
    puts nothing in the cache, an earlier one still does (the next chunk reads the system prompt from it); the
    samples are the padded path's, and outside `unread()` a call stores again."""
    model = tiny_model("tiny-qwen3", vocab_size=VOCAB)
    system = list(range(8, 30))
    prompts = [system + [40 + i] for i in range(4)]
    params = SamplingParams(n=2, max_new_tokens=3, seed=2)
    one_chunk = EmbeddedSampler(model, prefix_sharing="always")  # a short system prompt: would go the padded way
    with one_chunk.unread():
        assert_same(padded(model, prompts, params), one_chunk.generate(prompts, params))
    assert one_chunk.cache.tokens == 0 and one_chunk.counts.cached_tokens == 0
    one_chunk.generate(prompts[:1], params)
    assert one_chunk.cache.tokens > 0
    chunks = EmbeddedSampler(model, max_rows=2 * params.n)  # two prompts a chunk
    with chunks.unread():
        assert_same(padded(model, prompts, params, max_rows=2 * params.n), chunks.generate(prompts, params))
    assert chunks.counts.cached_tokens == len(system) and chunks.cache.counts.stored_tokens == chunks.cache.tokens > 0
    assert one_chunk.counts.padded_chunks == chunks.counts.padded_chunks == 0  # the last chunk reads the cache
    assert chunks.cache.match(prompts[3], len(prompts[3]), False).depth == len(system)  # not the last chunk's


@pytest.mark.parametrize("bump_version", [True, False])
def test_a_weight_update_empties_the_cache(bump_version):
    """After an optimizer-like in-place update the cached K/V are never read: the samples are those of the new
    weights, whether or not the version was bumped (the parameters' own version counters change)."""
    model = fresh_model("tiny-qwen3", vocab_size=VOCAB)
    sampler = EmbeddedSampler(model, version=1)
    prompts = [[9, 10, 11, 12, 13], [9, 10, 11, 14]]
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    sampler.generate(prompts, params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if bump_version:
        sampler.version = 2
    assert_same(padded(model, prompts, params, version=sampler.version), sampler.generate(prompts, params))
    assert sampler.cache.counts.invalidations == 1


def test_the_cache_stays_within_its_bounds_and_what_cannot_fit_is_recomputed():
    model = tiny_model("tiny-qwen3", vocab_size=VOCAB)
    prompts = [[8 + i, 9, 10, 11, 12, 13] for i in range(6)]
    params = SamplingParams(n=2, max_new_tokens=3, seed=0)
    small = EmbeddedSampler(model, prefix_cache_tokens=12)
    for _ in range(2):
        assert_same(padded(model, prompts, params), small.generate(prompts, params))
        assert small.cache.tokens <= 12
    assert small.cache.counts.evicted_tokens > 0
    tiny = EmbeddedSampler(model, prefix_cache_tokens=4)  # no prompt fits
    assert_same(padded(model, prompts, params), tiny.generate(prompts, params))
    assert tiny.cache.tokens == 0 and tiny.cache.counts.unstored_tokens > 0
    no_memory = EmbeddedSampler(model)
    no_memory.cache.memory_share = 0.0  # nothing fits beside the free memory
    assert_same(padded(model, prompts, params), no_memory.generate(prompts, params))
    assert no_memory.cache.bytes == 0
    with pytest.raises(ValueError, match="prefix_cache_tokens must be >= 0"):
        EmbeddedSampler(model, prefix_cache_tokens=-1)


def test_the_radix_tree_splits_nodes_and_matches_the_longest_prefix():
    cache = PrefixCache(100)
    kv_calls = []

    def kv_of(a, b):
        from treerl.attention.prefix_attention import KVRun
        kv_calls.append((a, b))
        return KVRun(a, b - a, {(0, 0): torch.arange(a, b, dtype=torch.float64).view(1, 1, -1, 1)},
                     {(0, 0): torch.zeros(1, 1, b - a, 1)})

    cache.insert([1, 2, 3, 4, 5], kv_of)
    cache.insert([1, 2, 3, 9], kv_of)  # splits [1..5] after 3
    assert kv_calls == [(0, 5), (3, 4)] and cache.tokens == 6
    found = cache.match([1, 2, 3, 4, 7], limit=4, needs_states=False)
    assert found.depth == 4
    keys = torch.cat([run.keys[(0, 0)][0, 0, :used, 0] for run, used in found.reads])
    assert keys.tolist() == [0, 1, 2, 3]  # each token's own K/V, across the split
    assert cache.match([1, 2, 3, 4, 5], limit=2, needs_states=False).depth == 2
    assert cache.match([7], limit=1, needs_states=False).depth == 0


@pytest.mark.parametrize("autocast, tol", [(None, 1e-5), (torch.bfloat16, 5e-2)])
def test_float32_and_bf16_mixed_samples_are_the_padded_paths(autocast, tol):
    """float32 weights, computed as stored or under bfloat16 autocast (trainer.precision=bf16-mixed): the same
    tokens, log-probs within the dtype's rounding."""
    model = fresh_model("tiny-qwen3", vocab_size=VOCAB, dtype=torch.float32, exact=False)
    prompts = [list(range(8, 30)), list(range(8, 26)) + [40], [41]]
    params = SamplingParams(n=6, max_new_tokens=8, seed=5, stop_token_ids=(3, 4, 5, 6))
    sampler = EmbeddedSampler(model, autocast=autocast)
    for _ in range(2):
        assert_same(padded(model, prompts, params, autocast=autocast), sampler.generate(prompts, params), tol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny-qwen3.5", "tiny-lfm2", "tiny-bamba"])
def test_hybrid_models_fork_their_state_per_row(shape):
    """Gated DeltaNet, Mamba2 and short convolutions: each node's state handed to its children, each row's forked;
    a cached prefix reused where its state was kept. Their mixers compute the gate and the decoding step in float32
    (1e-8 apart between two float64 runs that split a prompt differently): 1e-6."""
    model = fresh_model(shape, vocab_size=VOCAB)
    assert refusal(model) is None
    prompts = [[9, 10, 11, 12, 13, 14], [9, 10, 11, 12, 20], [9, 10, 11, 12, 13, 14, 15, 16], [30]]
    params = SamplingParams(n=3, max_new_tokens=6, seed=2, stop_token_ids=(3, 4))
    sampler = EmbeddedSampler(model)
    expected = padded(model, prompts, params)
    assert_same(expected, sampler.generate(prompts, params), tol=1e-6)
    assert_same(expected, sampler.generate(prompts, params), tol=1e-6)  # from the cache's states
    assert sampler.counts.cached_tokens > 0


def test_a_vision_language_model_shares_text_prompts_and_generates_image_prompts_the_padded_way():
    """Text prompts on Qwen2.5-VL go the shared way; prompts that show images go the padded way, counted (their
    samples: tests/rollout/sampling/test_embedded_images.py)."""
    from vision_models import sequence, vl_model

    model = vl_model("qwen2_5_vl")
    text = [[1, 5, 6, 7, 8], [1, 5, 6, 9]]
    params = SamplingParams(n=2, max_new_tokens=4, seed=0)
    sampler = EmbeddedSampler(model)
    assert_same(padded(model, text, params), sampler.generate(text, params))
    assert sampler.counts.unshared_calls == 0
    shown = sequence([[1, 5, 6], (0, 4, 4), [7]])
    reference = EmbeddedSampler(model, prefix_sharing=False).generate([shown.tokens.tolist()], params,
                                                                      images=[shown.images])
    assert_same(reference, sampler.generate([shown.tokens.tolist()], params, images=[shown.images]))
    assert sampler.counts.unshared_calls == 1


def test_a_model_that_attends_in_its_own_code_is_generated_the_padded_way():
    """Bloom computes ALiBi attention in its own code: refused by the probe, sampled the padded way, counted."""
    from zoo import build_tiny

    model = build_tiny("bloom")
    assert "own code" in refusal(model)
    sampler = EmbeddedSampler(model)
    prompts = [[5, 6, 7], [5, 6, 8]]
    params = SamplingParams(n=2, max_new_tokens=3, seed=0)
    assert_same(padded(model, prompts, params), sampler.generate(prompts, params))
    assert sampler.counts.unshared_calls == 1


@pytest.mark.slow
def test_multi_turn_episodes_that_branch_are_the_padded_paths(tokenizer):
    """guess_number episodes forking at turn 1: each turn's prompt extends the last; the shared sampler reads the
    history from its cache, and the step's counters say how much."""
    policy = tiny_model("tiny-qwen3", vocab_size=len(tokenizer))
    config = RolloutConfig(task="guess_number", prompts_per_step=3, group_size=2, branch_at=[1], branch_factor=2,
                           seed=1)
    padded_batch = Rollout(config, tokenizer, EmbeddedSampler(policy, prefix_sharing=False)).collect(0)
    shared_batch = Rollout(config, tokenizer, EmbeddedSampler(policy)).collect(0)
    assert len(padded_batch.sequences) == len(shared_batch.sequences) > 6
    for a, b in zip(padded_batch.sequences, shared_batch.sequences):
        assert a.tokens.tolist() == b.tokens.tolist() and a.info == b.info
        torch.testing.assert_close(a.fields["old_logprobs"], b.fields["old_logprobs"], rtol=0, atol=1e-9)
    metrics = shared_batch.stats.metrics()
    assert metrics["rollout/cached_tokens"] > 0 and 0 < metrics["rollout/prefix_hit_rate"] < 1
    assert metrics["rollout/prefill_tokens"] + metrics["rollout/cached_tokens"] < metrics["rollout/prompt_tokens"]
    assert "rollout/prefill_tokens" not in padded_batch.stats.metrics() or \
        padded_batch.stats.metrics()["rollout/prefill_tokens"] == 0


def test_an_agent_through_the_proxy_records_the_padded_paths_samples(chat, tokenizer):
    """Three requests of one conversation through the recording proxy: each extends the last call, whose tokens the
    cache holds; the recorded tokens and log-probs are the padded path's."""
    from rollout.agents.test_proxy import play

    policy = tiny_model("tiny-qwen3", vocab_size=len(tokenizer))

    async def agent(client):
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(3):
            reply = await client.chat.completions.create(model="p", messages=messages, max_tokens=5)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]

    recorded = {}
    for sharing in (False, True):
        sampler = EmbeddedSampler(policy, prefix_sharing=sharing)
        proxy = ChatProxy(sampler, chat, max_new_tokens=5)
        proxy.batcher.seed = 11
        proxy.start()
        try:
            recorded[sharing] = play(proxy, agent)[1]
        finally:
            proxy.stop()
    assert [c.parent for c in recorded[True]] == [None, 0, 1]
    assert_same([[c.completion for c in recorded[False]]], [[c.completion for c in recorded[True]]])
    assert sampler.counts.cached_tokens >= len(recorded[True][1].prompt) - 1 > 0


def test_a_chunk_shares_where_the_cache_is_read_or_kept_or_enough_is_shared():
    """Short prompts sharing little, nothing cached, nothing kept (a synchronous single-turn call): the padded way,
    counted; a long shared prefix, a cache hit and a call that stores: the shared way. The same samples each way."""
    model = tiny_model("tiny-qwen3", vocab_size=VOCAB)
    params = SamplingParams(n=3, max_new_tokens=4, seed=7, stop_token_ids=(3, 4, 5))
    short = [[10, 11, 12 + i, 20] for i in range(4)]
    enough = -(-SHARING_COST // sum(p.numel() for p in model.parameters()))  # tokens saved a wave that pay (2 waves)
    system = [8 + (i * 7) % (VOCAB - 8) for i in range(enough)]  # saves 2 x its length
    long = [system + [40 + i] for i in range(3)]
    sampler = EmbeddedSampler(model)
    with sampler.unread():
        assert_same(padded(model, short, params), sampler.generate(short, params))
        assert (sampler.counts.padded_chunks, sampler.counts.prefill_tokens) == (1, 16)
        assert_same(padded(model, long, params), sampler.generate(long, params))
        assert sampler.counts.padded_chunks == 1 and sampler.counts.prefill_tokens == 16 + len(system) + 3
    sampler.generate(short[:1], params)  # stores: shared
    assert sampler.counts.padded_chunks == 1 and sampler.cache.tokens > 0
    with sampler.unread():
        hit = [short[0] + [30], short[1]]  # one prompt extends what the cache holds
        assert_same(padded(model, hit, params), sampler.generate(hit, params))
    assert sampler.counts.padded_chunks == 1 and sampler.counts.cached_tokens == len(short[0])
    assert EmbeddedSampler(model).generate(short, params) and sampler.counts.unshared_calls == 0


@pytest.mark.parametrize("family", ["mamba", "gemma2"])
def test_families_the_padded_path_gets_wrong_are_exact_when_shared(family):
    """A pure Mamba model (the padded path's left padding runs into its state: log-probs off by ~1.6) and Gemma 2
    (soft-capping and a sliding window that binds; the padded path's left padding leaves rows with no visible key:
    NaN): the shared path's log-probs are the model's own forward on each prompt and completion alone."""
    from zoo import build_tiny, ordinary_ids, own_logprobs

    model = build_tiny(family, dtype=torch.float64)
    assert refusal(model) is None and padded_refusal(model) is not None
    ids = ordinary_ids(model, (12,), seed=1).tolist()
    prompts = [ids[:6], ids[:4] + ids[8:10], ids[:9], ids[10:11], ids[:6]]
    sampler = EmbeddedSampler(model, prefix_cache_tokens=0)  # short prompts, no cache: padded, were it exact
    groups = sampler.generate(prompts, SamplingParams(n=3, max_new_tokens=6, seed=0))
    assert sampler.counts.padded_chunks == 0
    for prompt, group in zip(prompts, groups):
        for completion in group:
            own = own_logprobs(model, prompt, completion.tokens)
            torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), own, rtol=0, atol=1e-6)
