"""`tidal store serve`: a store server process on its own.

A producer and a consumer, each in a process of its own, then reach the store at one
address with `RemoteStore(address)`, in either start order: a partition the server was
told to create (`--partition`) exists before any client connects, and one a client
creates can be waited for (`wait_partition`) or created again with the same settings
(`create_partition(..., exist_ok=True)`). The first line on stdout is the server's
address; the process serves until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from tidal.flow.store.client import TOKEN_ENV
from tidal.flow.store.memory import freeze_startup_objects
from tidal.flow.store.server import StoreServer
from tidal.flow.store.table import Store

DESCRIPTION = f"""\
Run a store server until Ctrl-C or SIGTERM, and print its address (tcp://HOST:PORT) as
the first line on stdout. Clients connect with RemoteStore(address, token=...).

Binding anything but loopback (--host 0.0.0.0, a LAN address) needs a token: --token, or
the {TOKEN_ENV} environment variable (which keeps it out of the process list); clients
read the same variable. --partition NAME:CONSUMER[,CONSUMER...] creates a partition
before the first client connects (repeat it for several); --capacity-rows,
--capacity-bytes and --lease-s apply to those partitions. --persist-dir DIR lets clients
save the store inside DIR (RemoteStore.save). Shared memory for large buffers between
processes of this host is on unless --no-shm (or TIDAL_STORE_SHM=0).

examples:
  tidal store serve --port 5555 --partition train:trainer
  TIDAL_STORE_TOKEN=s3cret tidal store serve --host 0.0.0.0 --port 5555 --capacity-rows 4096 --partition train:reward,trainer
"""


def build_parser(prog: str = "tidal store serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; any other needs a token)")
    parser.add_argument("--port", type=_port, default=0, help="TCP port; 0 picks a free one (default: 0, printed on the first line)")
    parser.add_argument("--token", default=None, help=f"the shared token clients must show (default: ${TOKEN_ENV}, else none)")
    parser.add_argument("--partition", action="append", default=[], type=_partition, metavar="NAME:CONSUMER[,CONSUMER...]", help="create this partition at start (repeatable)")
    parser.add_argument("--capacity-rows", type=_positive, default=None, help="rows each --partition holds before puts wait (default: no limit)")
    parser.add_argument("--capacity-bytes", type=_positive, default=None, help="bytes each --partition holds before puts wait (default: no limit)")
    parser.add_argument("--lease-s", type=float, default=300.0, help="seconds a consumer holds rows it got before they are delivered again (default: 300)")
    parser.add_argument("--persist-dir", default=None, help="the directory clients may save the store in (default: none may)")
    parser.add_argument("--no-shm", action="store_true", help="keep every byte on the sockets (no shared memory)")
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "tidal store serve") -> int:
    """Parse `argv`, serve until Ctrl-C or SIGTERM; the exit code (2: a bad argument)."""
    args = build_parser(prog).parse_args(argv)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    store = Store()
    try:
        for name, consumers in args.partition:
            store.create_partition(name, consumers=consumers, capacity_rows=args.capacity_rows, capacity_bytes=args.capacity_bytes, lease_s=args.lease_s, exist_ok=False)
        server = StoreServer(store, address=f"tcp://{_bracketed(args.host)}:{args.port}", token=token, shm=not args.no_shm, persist_dir=args.persist_dir)
    except ValueError as e:  # a refused bind (no token), a duplicate partition, a bad setting: named in the message
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    freeze_startup_objects()  # a process that is a store server: see `memory`
    print(server.address, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        return 130
    return 0


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {text}")
    return port


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _partition(text: str) -> tuple[str, list[str]]:
    name, _, consumers = text.partition(":")
    names = [c.strip() for c in consumers.split(",") if c.strip()]
    if not name or not names:
        raise argparse.ArgumentTypeError(f"--partition takes NAME:CONSUMER[,CONSUMER...], got {text!r}")
    return name, names


if __name__ == "__main__":
    sys.exit(main())

