"""The processes of a run and what starts them: the layer that knows every concrete class.

    cli.py            the `async-rl` command line (`entry` is the installed console script)
    launchers.py      LAUNCHERS: `local` (local.py, child processes) and `ray` (ray_launcher.py, ray_host.py)
    procs.py          spawning children through a fork server, one-line child errors, stopping them
    trainer_proc.py   the trainer process around TrainerLoop (async_rl/trainer/loop.py); trainer_ranks.py its ranks
    rollout_proc.py   the rollout process around RolloutController (async_rl/rollout/controller.py)
    serve.py          one embedded generation server; servers.py SERVER_LAUNCHERS: embedded, sglang_server.py,
                      vllm_server.py (external servers guarded by external_server.py); server_keeper.py restarts them
    supervision.py    restart budgets and the restart record; common.py what every launcher shares
    sim_cmd.py        `async-rl sim`

Nothing below this package imports it (tests/unit/test_import_layers.py). The repository's top-level
`launch/` folder holds entry scripts over this package (not installed).
"""
