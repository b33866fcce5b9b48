"""What every training loop shares: the config tree, `Run` (ranks, policy, optimizer, engine, one optimizer step),
`update` (epochs x minibatches on a batch), checkpoints and resume, metrics, stop signals, precision, export."""
