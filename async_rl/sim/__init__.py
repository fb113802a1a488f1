"""`async-rl sim`: a discrete-event model of a run, to choose the pool split and the staleness bound.

    profile = load_profile("configs/sim/areal_h800_r1distill_1p5b.yaml")
    cfg = sim_config(profile, ["mode=async", "max_staleness=4", "total_steps=20"])
    result = simulate(profile, cfg, Placement.pools(rollout=96, trainer=32))
    print(result.traj_per_s, result.staleness_hist)

The model runs generation servers (`server.py`: continuous batching, step time from the profile),
the rollout side (`rollout.py`) and the trainer (`trainer.py`) on one simulated clock (`clock.py`).
What decides admission, batching and staleness is not modelled but called: the real
`StalenessGate` (admission, restart of over-stale generations), the queue's `take_groups` and the
trainer's `split_by_age`, on a real `Config`. A change to those rules changes the prediction.
Profiles (`profile.py`) come from a run (`calibrate.py`) or from published GPU numbers (`gpu.py`).
"""

from async_rl.sim.lengths import LengthDist
from async_rl.sim.profile import Profile, load_profile, profile_from_dict, save_profile
from async_rl.sim.run import Placement, SimResult, sim_config, simulate

__all__ = ["LengthDist", "Placement", "Profile", "SimResult", "load_profile", "profile_from_dict", "save_profile",
           "sim_config", "simulate"]
