"""``python -m parallel.ft --port P --min-replicas N``: a fault-tolerance coordinator on its
own (:class:`parallel.ft.coordinator.Coordinator`), for jobs whose launcher does not run
one; it prints its address and serves until interrupted."""

from __future__ import annotations

import argparse
import time
from typing import Optional

from parallel.ft.coordinator import Coordinator


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m parallel.ft --port P``: a coordinator on its own."""
    p = argparse.ArgumentParser(prog="python -m parallel.ft",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--first-quorum", type=int, default=None)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    args = p.parse_args(argv)
    coordinator = Coordinator(min_replicas=args.min_replicas, first_quorum=args.first_quorum,
                              heartbeat_timeout=args.heartbeat_timeout, host=args.host,
                              port=args.port).start()
    print(f"coordinator at {coordinator.address_text}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        coordinator.close()


if __name__ == "__main__":
    main()
