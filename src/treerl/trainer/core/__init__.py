"""What every training loop shares: the config tree, `Run` (ranks, policy, optimizer, engine, one optimizer step),
`update` (epochs x minibatches on a batch), checkpoints and resume, metrics, stop signals, precision, export.

Steps 3 to 6 (docs/architecture.md) and what every loop keeps around them.
"""
