"""async_rl: a fully asynchronous RL trainer for language models (README.md; architecture in DESIGN.md).

Importing the package sets `OMP_WAIT_POLICY=PASSIVE` unless the environment already sets it: OpenMP
threads that finish their share of a parallel region then sleep at once instead of spinning for the
others. torch's CPU kernels (and the engine's compiled ones) open a parallel region per operation, and
the cores of a CPU run are shared: the trainer and the engine by design (`cores.share`), other jobs
often. With libgomp's default spin a region waits on a thread that is descheduled while its partner
burns the time slice: a bf16 decode step of SmolLM2-135M (64 sequences, 2 threads, a 2-core AMD EPYC
whose load average stood at 9-16) took 2.2-2.5 s spinning and 126-130 ms passive
(benchmarks/results/HISTORY.md). libgomp reads the variable once, when torch loads it: this import
must come before `import torch` (the command line's does; a script of its own imports async_rl first).
`OMP_WAIT_POLICY=ACTIVE` in the environment restores spinning.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
