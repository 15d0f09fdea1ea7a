"""Two (or more) processes of torch.distributed on the CPU with gloo, for the tests: :func:`spawn` runs
``fn(rank, world, *args)`` in each after :func:`init`."""
from __future__ import annotations

import os
import socket


def init(rank: int, world: int, port: int):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _run(rank, world, port, fn, args):
    import sys
    import torch.distributed as dist
    init(rank, world, port)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # done, and what the process computed is in its files: leave without running the interpreter's teardown, where
    # torch's gloo threads abort now and then ("terminate called without an active exception", SIGABRT) after a
    # collective that one rank refused; a failure above still raises, and spawn reports it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, args, monkeypatch, nprocs: int = 2):
    """Run ``fn(rank, world, *args)`` in ``nprocs`` spawned processes joined in one gloo group (``fn``: a
    module-level function, so that the processes can import it)."""
    import torch.multiprocessing as mp
    # torch's gloo processes abort now and then at exit ("terminate called without an active exception") while
    # their OpenMP workers spin (OpenMP's default), with or without fp4sim's kernels; sleeping workers keep the
    # checks about what the processes computed
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(nprocs, port, fn, args), nprocs=nprocs, join=True)
