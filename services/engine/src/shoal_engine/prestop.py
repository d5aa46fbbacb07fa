"""The engine pod's preStop hook: ``shoal-engine-prestop --port 8080``.

Calls the engine's ``GET /drain`` on the pod's own address (``POD_IP``, else loopback), which
the engine accepts only from its own pod, and waits for the answer: the engine has left the
rotation and moved its requests to other engines, or the drain deadline passed. Kubernetes then
sends SIGTERM. Prints the engine's answer (or why there was none) for the pod's events.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

from shoal_protos.addresses import http_url


def drain_url(host: str, port: int, rejoin_after_s: float) -> str:
    query = f"?rejoin_after_s={rejoin_after_s:g}" if rejoin_after_s else ""
    return f"{http_url(host, port)}/drain{query}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Drain this pod's engine by migration (preStop hook).")
    parser.add_argument("--port", type=int, required=True, help="the engine's HTTP port")
    parser.add_argument("--host", default=os.environ.get("POD_IP") or "127.0.0.1")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the answer")
    parser.add_argument("--rejoin-after", type=float, default=0.0, help="serve again after this long")
    args = parser.parse_args(argv)
    url = drain_url(args.host, args.port, args.rejoin_after)
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as reply:
            print(reply.read().decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        sys.exit(f"drain refused ({exc.code}): {exc.read().decode(errors='replace')}")
    except OSError as exc:
        # The engine is gone or not serving: nothing to drain; SIGTERM follows either way.
        sys.exit(f"cannot reach the engine at {url}: {exc}")


if __name__ == "__main__":
    main()
