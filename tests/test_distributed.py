"""Process start-up helpers: DeepSpeed's leaked /dev/shm all-reduce buffer is removed at the end of a run."""
import os
from pathlib import Path

import pytest

from recipe.train.distributed import release_shm_buffer


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this system")
def test_release_shm_buffer_removes_only_this_ranks_buffer(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # a port no real rendezvous uses
    monkeypatch.setenv("RANK", "1")
    prefix = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_"
    mine, peer = Path(prefix + "1"), Path(prefix + "0")
    try:
        mine.write_bytes(b"x")
        peer.write_bytes(b"x")
        release_shm_buffer()
        assert not mine.exists() and peer.exists()
        release_shm_buffer()  # nothing left to remove: no error
    finally:
        for path in (mine, peer):
            path.unlink(missing_ok=True)
