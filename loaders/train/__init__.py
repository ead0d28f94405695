"""Training on packed batches: attention backends, loss, step graphs, trainers, evaluation."""
