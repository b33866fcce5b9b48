"""TRL's environment_factory contract (trl 1.x) through treerl's recording proxy: a class's public methods are the
model's tools (schemas as transformers' get_json_schema writes them, the ones TRL renders), tool calls parsed in the
chat template's format and answered as tool messages, reward = get_reward(); failures dropped with their reason."""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from pathlib import Path

import pytest
from recorded import Recording, check_recorded, reply_of

from treerl.errors import UserError
from treerl.rollout import Rollout, RolloutConfig

HERE = Path(__file__).resolve().parent
ENV = "trl:trl_vault:Vault"
ROWS = [{"prompt": "Open the vault.", "code": 3}, {"prompt": "Open the vault.", "code": 7}]


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def opener(prompt: str, j: int) -> str:
    """A scripted policy: calls check with the code (even samples) or a wrong one, then says it is done."""
    if prompt.count("<tool>") and "open" in prompt.rsplit("<tool>", 1)[1] or "locked" in prompt:
        return "done"
    code = int(re.findall(r"The code is (\d)", prompt)[-1])
    guess = code if j % 2 == 0 else code + 1
    return f'<tool_call>{{"name": "check", "arguments": {{"guess": {guess}}}}}</tool_call>'


def collect(tokenizer, sampler, **overrides):
    values = {"env": ENV, "env_args": {"rows": ROWS}, "prompts_per_step": 2, "group_size": 2, "seed": 1,
              "max_new_tokens": 80, "env_timeout": 10, "max_turns": 3}
    rollout = Rollout(RolloutConfig(**{**values, **overrides}), tokenizer, sampler)
    try:
        return rollout.collect(0)
    finally:
        rollout.close()


def test_tools_are_what_trl_renders():
    from transformers.utils import get_json_schema
    from trl_vault import Vault

    from treerl.rollout.environments.trl_env import tool_schemas

    expected = get_json_schema(Vault(0).check)  # a bound method, as TRL hands the environment's methods over
    assert tool_schemas(Vault, ENV) == [expected]


def test_an_episode_calls_the_tool_sees_its_result_and_is_scored_by_get_reward(tokenizer, scripted):
    from trl_vault import Vault

    recording = Recording(scripted(opener))
    batch = collect(tokenizer, recording)
    assert not batch.stats.dropped, batch.stats.dropped_samples
    check_recorded(batch, recording)
    episodes = defaultdict(list)
    for seq in batch.sequences:
        episodes[seq.info["trajectory"]].append(seq)
    assert len(episodes) == 4 and all(len(calls) == 2 for calls in episodes.values())
    for name, calls in episodes.items():
        first, second = sorted(calls, key=lambda s: s.info["turn"])
        assert second.tokens[: len(first.tokens)].tolist() == first.tokens.tolist(), name
        prompt = tokenizer.decode(first.tokens)
        code = int(re.findall(r"The code is (\d)", prompt)[0])
        call = json.loads(tokenizer.decode(reply_of(first)).split("<tool_call>")[1].split("</tool_call>")[0])
        vault = Vault()  # the library's own scorer, for the call the model made
        vault.reset(code=code)
        result = vault.check(**call["arguments"])
        assert result in tokenizer.decode(second.tokens[len(first.tokens):]), name  # the tool's answer was shown
        assert first.info["reward"] == vault.get_reward(), name
    assert sorted({seq.info["reward"] for seq in batch.sequences}) == [0.0, 1.0]


@pytest.mark.parametrize(("fail", "reason", "message"), [
    ("reset", "env_raised", "reset raised RuntimeError: the vault's reset broke"),
    ("reward", "env_not_finite", "get_reward() returned nan"),
    ("slow", "env_timeout", "tool check did not return within 1.5 s (rollout.env_timeout)"),
])
def test_failures_drop_the_episode_with_their_reason(tokenizer, scripted, fail, reason, message):
    rows = [{**row, "fail": fail} for row in ROWS]
    batch = collect(tokenizer, scripted(opener), env_args={"rows": rows}, env_timeout=1.5)
    assert batch.stats.dropped == {reason: 4}, batch.stats.dropped
    assert message in batch.stats.dropped_samples[0].reason


def presser(prompt: str, j: int) -> str:
    """A scripted policy: presses once a call until the tool says done."""
    if "<tool>" in prompt and prompt.rsplit("<tool>", 1)[1].startswith("done"):
        return "all done"
    return '<tool_call>{"name": "press", "arguments": {"times": 1}}</tool_call>'


def presses(batch) -> dict[str, tuple[int, float]]:
    """Each episode's model calls and reward."""
    out: dict[str, list] = defaultdict(list)
    for seq in batch.sequences:
        out[seq.info["trajectory"]].append(seq)
    return {name: (len(calls), calls[0].info["reward"]) for name, calls in out.items()}


def test_no_bound_unless_set_and_at_the_bound_the_last_calls_are_not_run(tokenizer, scripted):
    """TRL runs tool rounds until the model stops calling tools (max_tool_calling_iterations=None): 5 presses and a
    last reply, 6 calls. rollout.max_turns=2 (TRL's max_tool_calling_iterations=1): the second reply's press is not
    run, and the episode is scored, not dropped. The reward is a reward function given the environments (TRL's
    reward_funcs), its log_metric values logged per environment."""
    unbounded = collect(tokenizer, scripted(presser), env="trl:trl_vault:Presser", env_args={},
                        reward_fn="trl_vault:pressed", max_turns=None)
    assert not unbounded.stats.dropped, unbounded.stats.dropped_samples
    assert set(presses(unbounded).values()) == {(6, 5.0)}
    assert {seq.info["env_metrics"]["messages"] for seq in unbounded.sequences} == {11.0}  # 6 replies, 5 results
    bounded = collect(tokenizer, scripted(presser), env="trl:trl_vault:Presser", env_args={},
                      reward_fn="trl_vault:pressed", max_turns=2)
    assert not bounded.stats.dropped, bounded.stats.dropped_samples
    assert set(presses(bounded).values()) == {(2, 1.0)}


def test_get_reward_and_a_reward_function_add_up_as_in_trl(tokenizer, scripted):
    batch = collect(tokenizer, scripted(opener), reward_fn="trl_vault:opened_twice")
    assert not batch.stats.dropped, batch.stats.dropped_samples
    assert sorted({seq.info["reward"] for seq in batch.sequences}) == [0.0, 3.0]  # get_reward 1 + the function's 2


def test_an_environment_call_past_its_limit_does_not_hold_the_step(tokenizer, scripted):
    """get_reward sleeps 30 s, rollout.env_timeout is 1 s: the episodes are dropped (env_timeout) with their prompt
    and last reply, and the step ends without waiting for the abandoned calls."""
    started = time.monotonic()
    batch = collect(tokenizer, scripted(opener), env_args={"rows": [{**row, "fail": "hang"} for row in ROWS]},
                    env_timeout=1)
    assert time.monotonic() - started < 15
    assert batch.stats.dropped == {"env_timeout": 4}, batch.stats.dropped
    first = batch.stats.dropped_samples[0]
    assert "get_reward did not return within 1 s" in first.reason
    assert first.prompt == "Open the vault." and first.completion == "done"


def test_a_system_prompt_beside_a_rows_own_is_refused(tokenizer, scripted):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Open it."}],
             "code": 3}]
    with pytest.raises(UserError, match="rollout.system_prompt is set and row 0 .* has a system message of its own"):
        Rollout(RolloutConfig(env=ENV, env_args={"rows": rows}, system_prompt="Be kind."), tokenizer, scripted(opener))


@pytest.mark.parametrize(("env", "env_args", "message"), [
    (ENV, {"rows": ROWS, "colour": 1}, r"env_args \['colour'\] do not fit Vault\(digits"),
    (ENV, {"rows": []}, "env_args.rows must be a non-empty list"),
    ("trl:trl_vault:Nothing", {}, "has no attribute 'Nothing'"),
    ("trl:trl_vault:Presser", {}, "Presser has no get_reward\\(\\) and rollout.reward_fn is not set"),
])
def test_bad_names_and_arguments_are_refused_before_sampling(tokenizer, scripted, env, env_args, message):
    with pytest.raises(UserError, match=message):
        Rollout(RolloutConfig(env=env, env_args=env_args), tokenizer, scripted(opener))
