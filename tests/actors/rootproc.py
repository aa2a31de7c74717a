"""A root supervisor as its own process, for the exit-code tests.

usage: python -m tests.actors.rootproc {crashloop,serve} {inprocess,process}
Prints `pid <n>` for every child run it sees, then either crashes its child until the tree gives
up, or waits for SIGTERM.
"""

import sys

import anyio

from sonar.actors import ChildSpec, SupervisorSpec, parse_placement, run_root
from tests.actors.sample import Crash, Sample


def main() -> int:
    mode, placement = sys.argv[1], parse_placement(sys.argv[2])
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec("steady", Sample, placement=placement, ping_interval=None),
            SupervisorSpec(
                "inner",
                [ChildSpec("flaky", Sample, placement=placement, ping_interval=None)],
                max_restarts=1,
                period=30,
            ),
        ],
        max_restarts=1,
        period=30,
    )

    async def crashloop(sup) -> None:
        seen: set[int] = set()
        while True:
            info = sup.tree()
            for node in (info.find("steady"), info.find("flaky")):
                if node is not None and node.pid and node.pid not in seen:
                    seen.add(node.pid)
                    print(f"pid {node.pid}", flush=True)
            flaky = info.find("flaky")
            inner = sup.child("inner").child
            if flaky is not None and flaky.state == "running" and inner is not None:
                await inner.child("flaky").ref.send(Crash())
            await anyio.sleep(0.05)

    async def report(sup) -> None:
        info = sup.tree()
        for name in ("steady", "flaky"):
            print(f"pid {info.find(name).pid}", flush=True)
        print("ready", flush=True)
        await anyio.sleep_forever()

    return run_root(spec, crashloop if mode == "crashloop" else report)


if __name__ == "__main__":
    sys.exit(main())
