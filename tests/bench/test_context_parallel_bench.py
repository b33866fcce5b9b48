"""`treerl bench --cp`: the measured table comes from real ranks, and the GPU model says what its constants say."""

from __future__ import annotations

import pytest

from treerl.bench.context_parallel import (CLUSTERS, CpBenchConfig, cluster_table, measure, predicted_step,
                                           qwen3_5_text, qwen3_8b)
from treerl.bench.flops import mixer_rates


def test_the_gpu_model_divides_compute_and_charges_traffic():
    """One GPU: no traffic; R GPUs: 1/R of the compute plus traffic that grows with R, and the slower link costs more;
    the longer the trajectory, the better CP's efficiency (attention compute grows as the square, traffic linearly)."""
    config = qwen3_8b()
    nvlink, infiniband = CLUSTERS
    one = predicted_step(config, 32768, 1, nvlink)
    assert one["comm_s"] == 0.0
    four = predicted_step(config, 32768, 4, nvlink)
    assert four["compute_s"] == pytest.approx(one["compute_s"] / 4)
    assert 0 < four["comm_s"] < predicted_step(config, 32768, 4, infiniband)["comm_s"]
    rows = cluster_table(config, [16384, 131072], [8])
    by = {(r["cluster"], r["tokens"], r["path"]): r["efficiency"] for r in rows}
    for cluster in CLUSTERS:
        for path in ("sharded", "replicated"):
            assert by[cluster.name, 16384, path] < by[cluster.name, 131072, path] <= 1.0


def test_the_gpu_model_charges_a_sharded_path_its_queries_and_gives_back_its_memory():
    """The path's K/V sharded: a rank holds 1/R of the store (K/V and their float32 gradients: 6 bytes an element in
    bf16) and sends the calls' queries to the shards besides the keys; replicated: the whole store, the keys only."""
    config = qwen3_8b()
    nvlink, _ = CLUSTERS
    sharded, replicated = (predicted_step(config, 131072, 8, nvlink, path=path) for path in ("sharded", "replicated"))
    one = predicted_step(config, 131072, 1, nvlink)
    assert one["path_gib"] == replicated["path_gib"] == pytest.approx(8 * sharded["path_gib"])
    assert one["path_gib"] == pytest.approx(131072 * 36 * 2 * 8 * 128 * 6 / 2**30)
    assert sharded["compute_s"] == replicated["compute_s"] and sharded["comm_s"] > replicated["comm_s"] > 0


def test_the_gpu_model_runs_a_hybrids_mixers_side_by_side_or_in_turn():
    """Qwen3.5's text body (3 Gated DeltaNet layers to an attention layer, 8 runs of 3): side by side a later rank adds
    its transfer columns (K x K beside each [K, V] state: as much state work again) and all-gathers states and
    transfers; in turn each run of 3 mixer layers is a wavefront 3 + R - 1 pieces long. Only the 8 attention layers
    hold K/V. Side by side wins by more as R grows."""
    config = qwen3_5_text()
    mixer = mixer_rates(config)
    assert mixer.runs == (3,) * 8 and mixer.transfer_per_layer == 6 * 32 * 128 * 128  # 32 value heads, K = V = 128
    assert mixer.shared_bytes == 4 * 2 * 32 * 128 * 128
    nvlink, _ = CLUSTERS
    step = lambda cp, mixers: predicted_step(config, 131072, cp, nvlink, mixers=mixers, mixer=mixer)
    one = predicted_step(config, 131072, 1, nvlink, mixer=mixer)
    assert one["path_gib"] == pytest.approx(131072 * 8 * 2 * 4 * 256 * 6 / 2**30)
    for cp in (2, 8):
        side, turn = step(cp, "side-by-side"), step(cp, "in-turn")
        assert one["compute_s"] / cp < side["compute_s"] < turn["compute_s"], cp
        assert side["comm_s"] > 0 and turn["comm_s"] > 0
    gain = lambda cp: step(cp, "in-turn")["step_s"] / step(cp, "side-by-side")["step_s"]
    assert 1 < gain(2) < gain(8)
    assert {r["mixers"] for r in cluster_table(config, [131072], [1, 2])} == {"-", "side-by-side", "in-turn"}


@pytest.mark.slow  # two processes
def test_measured_ranks_hold_less_and_send_what_the_key_gathers_send():
    """2 ranks on a 512-token trajectory of tiny-qwen3 (2 layers, 2 K/V heads of 16): each rank's peak is below one
    process's, and what it sends is at least the K/V all-gather's (R - 1) / R of the path's K/V a layer."""
    rows = measure(CpBenchConfig(shape="tiny-qwen3", vocab_size=256, tokens=512, chunk_tokens=128, ranks=[1, 2]))
    one, sharded, replicated = rows
    assert (sharded["path"], replicated["path"]) == ("sharded", "replicated")
    assert one["sent_mib_per_rank"] == 0 and replicated["sent_mib_per_rank"] > 0
    kv_bytes = 512 * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x kv heads x head_dim x float32
    assert replicated["sent_mib_per_rank"] * 2**20 >= kv_bytes / 2
    assert sharded["sent_mib_per_rank"] > replicated["sent_mib_per_rank"]  # the queries travel to the path's shards
    assert 2 * sharded["path_store_mib_per_rank"] == replicated["path_store_mib_per_rank"]
    assert max(sharded["peak_mib_per_rank"], replicated["peak_mib_per_rank"]) < one["peak_mib_per_rank"]
