"""`moepar plan`: choose the layout for a model and a cluster before any GPU is rented.

| module         | concern                                                                   |
|----------------|---------------------------------------------------------------------------|
| cli.py         | the command: options, the printed plan                                    |
| source.py      | MODEL (TOML or Hugging Face config.json) and --from-run's load factor     |
| hardware.py    | GPU presets and the achievable fractions assumed                          |
| candidates.py  | every layout `moepar train` accepts, costed and ranked; rejected families |
| memory.py      | parameters, gradients, AdamW state per rank (closed form = the simulation)|
| activations.py | bytes autograd saves per layer, recompute modes, dispatch rows            |
| footprint.py   | peak memory per rank: in-flight micro-batches, buffers, transients        |
| flops.py       | forward FLOPs per token of each part of the model                         |
| steptime.py    | step time: compute, tp, all-to-all, pipeline, ZeRO, optimizer             |
| report.py      | the table, breakdowns, rejected lines, JSON                               |
| writer.py      | --write: the best runnable plan as a run config                           |
| rules.py       | --explain: the strategy the planner applies                               |
"""
