"""samples.jsonl's rows: each trajectory's prompt and reply (or turns, with what the environment showed between them)
as the model saw and wrote them, its reward and metrics; a limit spread over the prompts; dropped samples with why."""

from __future__ import annotations

from treerl.rollout import Rollout, RolloutConfig
from treerl.rollout.tasks import DatasetTask
from treerl.rollout.workflows.trajectories import sample_rows


def test_single_turn_rows_spread_over_prompts_and_dropped_samples(tokenizer, scripted):
    def reply(prompt: str, j: int) -> str:
        return "boom" if j == 2 else str(j)

    def reward(prompt, completion, answer):
        if completion == "boom":
            raise ValueError("cannot score boom")
        return float(completion)

    rollout = Rollout(RolloutConfig(prompts_per_step=3, group_size=3, max_new_tokens=8), tokenizer, scripted(reply))
    rollout.task = rollout.workflow.task = DatasetTask([([{"role": "user", "content": f"q{k}"}], k) for k in range(3)],
                                                       reward, shuffle=False)
    batch = rollout.collect(0)
    rows = sample_rows(batch.sequences, batch.stats, tokenizer, limit=4)
    kept = [r for r in rows if "dropped" not in r]
    assert [(r["group"], r["reply"]) for r in kept] == [("s0/p0/row0", "0<eos>"), ("s0/p1/row1", "0<eos>"),
                                                        ("s0/p2/row2", "0<eos>"), ("s0/p0/row0", "1<eos>")]
    assert kept[3]["reward"] == 1.0 and kept[0]["prompt"].endswith("<user>q0<eos><assistant>")
    assert kept[0]["finish_reason"] == "stop" and kept[0]["metrics"] == {}
    dropped = [r for r in rows if "dropped" in r]
    assert len(dropped) == 3 and "cannot score boom" in dropped[0]["dropped"] and dropped[0]["completion"] == "boom"
    assert len(sample_rows(batch.sequences, batch.stats, tokenizer)) == 6 + 3  # no limit: every kept one


def test_a_multi_turn_trajectory_shows_its_turns(tokenizer, scripted):
    rollout = Rollout(RolloutConfig(task="guess_number", prompts_per_step=1, group_size=1, branch_at=[],
                                    max_turns=3), tokenizer, scripted(lambda prompt, j: "1" if prompt.count("<tool>") < 1
                                                                      else "2"))
    batch = rollout.collect(0)
    [row] = sample_rows(batch.sequences, batch.stats, tokenizer)
    secret = rollout.task.prompts(0, 1)[0].answer
    assert row["prompt"] == "<bos><user>guess 1-9<eos><assistant>"
    assert row["trajectory"] == batch.sequences[0].info["trajectory"] and row["group"] == "s0/p0"
    assert row["turns"][0] == {"reply": "1<eos>"}
    assert secret > 1 and row["turns"][1] == {"shown": "<tool>higher<eos><assistant>", "reply": "2<eos>"}
    assert row["reward"] == batch.sequences[-1].info["reward"] and "reply" not in row
