"""Recipe: a whole run on this machine (trainer, rollout side, generation servers as local processes).

    python launch/run_local.py                                   # the CPU demo config, 20 steps
    python launch/run_local.py --config configs/smollm2_arith.yaml max_staleness=2

The same as `async-rl run --config C [key=value ...]`; a script run as a file over the installed
package (`pip install .`), not a module of it.
"""

import argparse

from async_rl.launch.cli import entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", default="configs/debug_cpu.yaml", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.lr=1e-5")
    args = parser.parse_intermixed_args()
    entry(["run", "--config", args.config, *args.overrides])


if __name__ == "__main__":
    main()
