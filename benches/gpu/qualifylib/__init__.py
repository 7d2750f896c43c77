"""The parts of `benches/gpu/qualify.py` (the entry point and its documentation):

* `common`: the geometry (Llama-3-8B), block patterns, ranges, GB/s;
* `sides`: what runs in the producer and consumer processes (Mooncake through
  `orbitkv`, NIXL, torch), one command per method;
* `harness`: the orchestrating process: children, a run's steps and results;
* `suites`: the steps of each suite, and `run`;
* `report`: `results.json` and `results.md` from the runs' files.
"""
