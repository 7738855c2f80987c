"""Tensor parallelism on torch.distributed: a model sharded over ranks (spawned processes on this
machine, or a torchrun launch), rank 0 running the engine. See executor.py for the rank 0 side,
worker.py for the others, sharding.py for which rank holds what."""
