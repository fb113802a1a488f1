"""Recipe: a run placed on a Ray cluster (trainer ranks, rollout side, generation servers as Ray actors).

    ray start --head --port 6379                                # on the head node (then `ray start --address` on the others)
    python launch/ray_cluster.py --address HEAD_IP:6379 --config configs/gpu_ray.yaml

The same as `async-rl run --config C launcher=ray ray.address=ADDRESS` (docs/deployment.md: bundle
sizes, what a cluster spread over machines needs). Needs the `ray` extra (`pip install .[ray]`).
A script run as a file over the installed package.
"""

import argparse

from async_rl.launch.cli import entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="", help="the cluster (HOST:6379, ray://HOST:10001, auto); empty: a local one")
    parser.add_argument("--config", "-c", default="configs/debug_cpu.yaml", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.world_size=2")
    args = parser.parse_intermixed_args()
    cluster = [f"ray.address={args.address}"] if args.address else []
    entry(["run", "--config", args.config, "launcher=ray", *cluster, *args.overrides])


if __name__ == "__main__":
    main()
