"""The out-of-memory message of a training step (the run-level path, an injected CUDA OOM exiting 2, is in
tests/test_bad_inputs.py)."""
from __future__ import annotations

import torch

from recipe.config_memory import MemoryOptions
from recipe.lifecycle.oom import out_of_memory_message
from recipe.parallel.dims import ParallelDims

CP2 = ParallelDims(world_size=2, cp=2)


def test_message_names_the_length_per_cp_rank_and_the_next_switches():
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity ...")
    on = MemoryOptions(loss_chunk_size=4096, checkpoint_ttt_steps=True, attention_tile_size=1024)
    msg = out_of_memory_message(error, step=7, rank=3, device=torch.device("cpu"), shape=(1, 1, 65536), memory=on,
                                dims=CP2, max_length=65536)
    first, *switches = msg.splitlines()
    assert first == ("out of memory at step 7 on a micro-batch of 1 sample(s) padded to 65536 tokens (32768 per cp "
                     "rank) on rank 3; cpu: no allocator statistics (CUDA out of memory. Tried to allocate 8.00 GiB. "
                     "GPU 0 has a total capacity ...). Try (DeepSpeed JSON or flags):")
    assert len(switches) == 5 and all(line.startswith("  - ") for line in switches)
    assert 'a smaller "memory.loss_chunk_size" (now 4096)' in msg
    assert '"memory": {"teacher_logits_once": false}' in msg  # the table of teacher logits beside the chunks
    streamed = out_of_memory_message(error, step=7, rank=3, device=torch.device("cpu"), shape=(1, 1, 65536),
                                     memory=MemoryOptions(loss_chunk_size=4096, checkpoint_ttt_steps=True,
                                                          teacher_logits_once=False), dims=CP2, max_length=65536)
    assert "teacher_logits_once" not in streamed and len(streamed.splitlines()) == 5
    assert 'a smaller "memory.attention_tile_size" (now 1024)' in msg
    assert "checkpoint_ttt_steps" not in msg  # already on: not suggested
    assert "a larger cp_size (now 2" in msg and "--max-length (now 65536)" in msg
    packed = out_of_memory_message(error, step=2, rank=0, device=torch.device("cpu"), shape=(8, 2, 4096), memory=on,
                                   dims=ParallelDims(world_size=1), max_length=2048)
    assert packed.startswith("out of memory at step 2 on a micro-batch of 8 sample(s) packed into 2 row(s) of 4096 "
                             "tokens on rank 0; ")


def test_message_when_the_target_forward_ran_out():
    off = MemoryOptions(loss_chunk_size=None, checkpoint_ttt_steps=False, attention_tile_size=None)
    msg = out_of_memory_message(torch.OutOfMemoryError(""), step=1, rank=0, device=torch.device("cpu"), shape=None,
                                memory=off, dims=ParallelDims(world_size=1), max_length=2048)
    assert "out of memory at step 1 while building its micro-batches (target forward) on rank 0" in msg
    assert '"memory": {"loss_chunk_size": 4096} (now null' in msg
    assert '"memory": {"checkpoint_ttt_steps": true}' in msg
    assert '"memory": {"attention_tile_size": 1024} (now null' in msg
    assert "(OutOfMemoryError). Try" in msg and len(msg.splitlines()) == 6
