"""Tensor and expert parallelism: every rank holds a slice of the weights (TP) or a range of the routed
experts (EP) and runs the same step.

collectives.py  every place ranks talk (nothing else calls torch.distributed)
sharding.py     which parameter splits how; each rank's config and checkpoint slices
expert_parallel.py  each rank's range of routed experts; their partial sum all-reduced per MoE layer
expert_source.py  an EP rank's view of a checkpoint: its own experts' tensors only (the others never read)
worker.py       a rank > 0: load its slice, then run the steps rank 0 broadcasts
group.py        rank 0's side: start the workers, check their configs, run a step on all ranks
heartbeat.py    hang detection: each worker's heartbeat thread, rank 0's watchdog
launch.py       under torchrun: the rendezvous from its environment; ranks >= 1 serve steps
spawn.py        how rank 0 starts a worker: a fresh `python`, never re-running the caller's main module
"""
