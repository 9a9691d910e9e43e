"""Sweeps: grids of replay cells over one target, on one machine, a Ray cluster or Slurm.

A cell is one frozen config (target, cut, knowledge, defense, attacks, budget, seed),
identified by the hash of its canonical JSON (`cells`). Workers (`worker`) run cells and
return predictions and records; the driver (`driver`) alone writes them into one study
directory (`study`), create-if-absent, and appends to its hash-chained log. Backends
(`backends`): in process, Ray actors, submitit (Slurm). `frontier` compares attacks at
matched FLOPs.
"""
