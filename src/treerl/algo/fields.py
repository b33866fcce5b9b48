"""Fill per-token fields from a no-grad engine pass over the tree: reference and proximal
log-probs for the policy loss, the critic's values for GAE.

Step 3 (docs/architecture.md): beside the advantages, before the update.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from treerl.engine.base import Engine
from treerl.tree import TokenSequence


def fill_fields(engine: Engine, model: PreTrainedModel, sequences: Sequence[TokenSequence], outputs: dict[str, str]) -> None:
    """Run `engine.forward` once and store outputs as fields, in place: e.g. `{"logprobs": "ref_logprobs"}`.

    Typical calls: the reference model -> `{"logprobs": "ref_logprobs"}`; the policy before an
    update (decoupled PPO) -> `{"logprobs": "prox_logprobs"}`; the critic with a `ValueHead`
    engine -> `{"values": "values"}`. Each stored field is exactly what the engine returned
    (position 0 holds 0 for shifted heads) on the device of the sequence's tokens.
    """
    results = engine.forward(model, sequences)
    for seq, out in zip(sequences, results):
        for output, name in outputs.items():
            if output not in out:
                raise KeyError(f"the engine's head has no output {output!r} (it has {', '.join(out)})")
            seq.fields[name] = out[output].detach().to(seq.tokens.device)
