"""The run's balancer keeps every rank's measured micro-batch times in the loop state (what a checkpoint saves) and
refits its cost model from them, also after a resume."""

from __future__ import annotations

import numpy as np
import torch

from treerl.distributed import CostModel, DistEnv
from treerl.trainer.core import balancer as balancer_module
from treerl.trainer.core.balancer import COST_MIN_SAMPLES, COST_WINDOW, Balancer
from treerl.trainer.core.config import TrainerConfig
from treerl.trainer.core.loop_state import LoopState


def _two_ranks(monkeypatch, other_rank: list) -> Balancer:
    """A balancer on rank 0 of two, whose all_gather returns `other_rank`'s samples beside its own."""

    def all_gather_object(out: list, mine: list) -> None:
        out[0], out[1] = mine, other_rank

    monkeypatch.setattr(balancer_module.dist, "all_gather_object", all_gather_object)
    return Balancer(DistEnv(0, 2, 0, torch.device("cpu")), TrainerConfig(), LoopState())


def test_measured_times_of_every_rank_go_into_the_loop_state_and_refit_the_cost_model(monkeypatch, tmp_path):
    rng = np.random.default_rng(0)
    samples = [(rng.uniform(1, 100, 6), float(rng.uniform(0.1, 1))) for _ in range(COST_MIN_SAMPLES)]
    balancer = _two_ranks(monkeypatch, samples[COST_MIN_SAMPLES // 2 :])
    assert balancer.cost == CostModel()
    balancer.record(samples[: COST_MIN_SAMPLES // 2])
    state = balancer.loop_state
    assert [seconds for _, seconds in state.cost_samples] == [seconds for _, seconds in samples]
    assert balancer.cost != CostModel()  # refitted once there were enough samples
    torch.save(state.to_dict(), tmp_path / "loop.pt")  # plain lists and floats: what a checkpoint can hold
    resumed = Balancer(balancer.env, balancer.trainer, LoopState.from_dict(torch.load(tmp_path / "loop.pt",
                                                                                        weights_only=True)))
    resumed.fit()
    assert resumed.cost == balancer.cost


def test_only_the_latest_window_of_samples_is_kept(monkeypatch):
    balancer = _two_ranks(monkeypatch, [])
    for i in range(COST_WINDOW + 3):
        balancer.record([(np.full(6, i + 1.0), 0.5)])
    kept = balancer.loop_state.cost_samples
    assert len(kept) == COST_WINDOW and kept[0][0][0] == 4.0 and kept[-1][0][0] == COST_WINDOW + 3.0


def test_a_context_parallel_rank_trains_the_sequences_it_runs_alone_with_its_engine_unsplit():
    """`Learner.engine_alone`: the same engine (under bf16-mixed: the same autocast around it) without the
    context-parallel ranks, so a rank's own sequences run whole calls with no collective."""
    from treerl.attention.context_parallel import ContextParallel
    from treerl.engine import DfsEngine
    from treerl.engine.autocast import AutocastEngine
    from treerl.trainer.core.learner import without_context_parallel

    split = DfsEngine(chunk_tokens=64, context_parallel=ContextParallel(0, 2))
    alone = without_context_parallel(split)
    assert alone.context_parallel is None and alone.chunk_tokens == 64
    mixed = without_context_parallel(AutocastEngine(split, torch.bfloat16))
    assert isinstance(mixed, AutocastEngine) and mixed.dtype == torch.bfloat16
    assert mixed.engine.context_parallel is None and split.context_parallel is not None
