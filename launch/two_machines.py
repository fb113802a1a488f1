"""Recipe: the two sides of a run on two machines, linked by the trajectory queue at the trainer's address.

    async-rl keys --out keys/                                  # once; copy keys/ to both machines
    python launch/two_machines.py train   --host 10.0.0.1 --keys keys/ --config C    # on the trainer's machine
    python launch/two_machines.py rollout --host 10.0.0.1 --keys keys/ --config C    # on the rollout machine

Both sides get the same `transport.addr` (tcp://HOST:PORT, HOST the trainer machine's address), the
CURVE keys that an address other machines reach needs (`transport.curve_keys_dir`), and the `zmq` weight
transport (weights travel on the queue's connection: no shared file system). The same as
`async-rl train|rollout --config C transport.addr=... transport.curve_keys_dir=... weight_sync.transport=zmq`
(docs/deployment.md). A script run as a file over the installed package.
"""

import argparse

from async_rl.launch.cli import entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("side", choices=["train", "rollout"], help="the side this machine runs")
    parser.add_argument("--host", required=True, help="the trainer machine's address, as the rollout machine reaches it")
    parser.add_argument("--port", type=int, default=5555, help="the trainer's queue port")
    parser.add_argument("--keys", required=True, help="the directory `async-rl keys --out` wrote (on both machines)")
    parser.add_argument("--config", "-c", default="configs/debug_cpu.yaml", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. run_dir=runs/a")
    args = parser.parse_intermixed_args()
    entry([args.side, "--config", args.config, f"transport.addr=tcp://{args.host}:{args.port}",
           f"transport.curve_keys_dir={args.keys}", "weight_sync.transport=zmq", *args.overrides])


if __name__ == "__main__":
    main()
