"""Realistic log excerpts of failed jobs (several files each: ranks, launcher, kernel log)."""

XID79_THEN_TIMEOUTS = {
    "rank0.log": """\
[rank0]:[W603 11:58:01.100000000 ProcessGroupNCCL.cpp:1250] Warning: TORCH_NCCL_AVOID_RECORD_STREAMS is the default now
step 18230 | loss 2.0417 | lr 2.9e-04 | 412.3 TFLOP/s
[rank0]:[E603 12:10:05.483726517 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=18234, OpType=ALLREDUCE, NumelIn=52428800, NumelOut=52428800, Timeout(ms)=600000) ran for 600064 milliseconds before timing out.
[rank0]:[E603 12:10:05.484012443 ProcessGroupNCCL.cpp:2168] [PG ID 0 PG GUID 0(default_pg) Rank 0] Timeout at NCCL work: 18234, last enqueued NCCL work: 18234, last completed NCCL work: 18233.
[rank0]:[E603 12:10:05.484100000 ProcessGroupNCCL.cpp:667] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.
terminate called after throwing an instance of 'c10::DistBackendError'
""",
    "rank5.log": """\
step 18230 | loss 2.0409 | lr 2.9e-04
[rank5]:[E603 12:00:09.120000000 ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank 5] Process group watchdog thread terminated with exception: CUDA error: unspecified launch failure
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
""",
    "node1-kern.log": """\
Jun  3 11:59:58 node1 kernel: [1832201.112233] mlx5_core 0000:c1:00.0: mlx5_fw_tracer_handle_traces:741:(pid 12): FW tracer event
Jun  3 12:00:07 node1 kernel: [1832210.554411] NVRM: GPU at PCI:0000:3b:00: GPU-4f1d0c1a-1b2c-3d4e-5f60-718293a4b5c6
Jun  3 12:00:07 node1 kernel: [1832210.554420] NVRM: Xid (PCI:0000:3b:00): 79, pid=14871, name=python, GPU has fallen off the bus.
Jun  3 12:00:07 node1 kernel: [1832210.554431] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.
""",
}

OOM_ON_ONE_RANK = {
    "rank3.log": """\
2024-06-03 12:00:01,002 - INFO - step 420 loss 3.112
Traceback (most recent call last):
  File "/workspace/train.py", line 211, in <module>
    loss = model(batch).loss
  File "/usr/lib/python3/dist-packages/torch/nn/modules/module.py", line 1532, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 3 has a total capacity of 79.11 GiB of which 2.06 GiB is free. Including non-PyTorch memory, this process has 77.04 GiB memory in use. Of the allocated memory 71.23 GiB is allocated by PyTorch, and 4.12 GiB is reserved by PyTorch but unallocated.
""",
    "rank0.log": """\
2024-06-03 12:00:01,010 - INFO - step 420 loss 3.107
2024-06-03 12:00:04,311 - ERROR - collective failed
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.20.5
ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.
Last error:
NET/IB : Got completion from peer 10.0.3.17<58120> with status=IBV_WC_WR_FLUSH_ERR(5) opcode=0 len=0 vendor err 249 (Recv)
""",
    "launcher.log": """\
[2024-06-03 12:00:09,500] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 1) local_rank: 3 (pid: 90211) of binary: /usr/bin/python3
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
""",
}

IB_RETRY_EXCEEDED = {
    "rank12.log": """\
node4:771:2210 [4] NCCL INFO Channel 02/0 : 12[4] -> 20[4] [send] via NET/IB/3
2024-06-03T12:00:00Z step 9000 loss 1.98
node4:771:2263 [4] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 10.0.5.21<41234> with status=IBV_WC_RETRY_EXC_ERR(12) opcode=0 len=0 vendor err 129 (Send) localGid ::ffff:10.0.5.12 remoteGids::ffff:10.0.5.21 hca mlx5_3
node4:771:2263 [4] NCCL INFO transport/net.cc:1285 -> 6
2024-06-03T12:10:00Z [rank12]:[E603 12:10:00.100000000 ProcessGroupNCCL.cpp:632] [Rank 12] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=90012, OpType=_ALLGATHER_BASE, NumelIn=1048576, NumelOut=33554432, Timeout(ms)=600000) ran for 600010 milliseconds before timing out.
""",
}

KERNEL_OOM_KILL = {
    "launcher.log": """\
[2024-06-03 12:00:31,204] torch.distributed.elastic.multiprocessing.api: [WARNING] Sending process 4012 closing signal SIGTERM
[2024-06-03 12:00:31,205] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 1 (pid: 4013) of binary: /usr/bin/python3
""",
    "dmesg.log": """\
[Mon Jun  3 12:00:30 2024] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0
[Mon Jun  3 12:00:30 2024] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,task_memcg=/user.slice,task=python,pid=4013,uid=1000
[Mon Jun  3 12:00:30 2024] Out of memory: Killed process 4013 (python) total-vm:812345612kB, anon-rss:501234560kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:1002112kB oom_score_adj:0
""",
}

SHM_BUS_ERROR = {
    "train.log": """\
2024-06-03 12:00:00,000 INFO epoch 0 step 10
ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).
Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/torch/utils/data/dataloader.py", line 1133, in _try_get_data
RuntimeError: DataLoader worker (pid 38112) is killed by signal: Bus error. It is possible that dataloader's workers are out of shared memory. Please try to raise your shared memory limit.
""",
}

DISK_FULL_AT_CHECKPOINT = {
    "rank0.log": """\
2024-06-03 12:00:00,000 INFO saving checkpoint step_12000
Traceback (most recent call last):
  File "/usr/lib/python3/dist-packages/torch/distributed/checkpoint/filesystem.py", line 470, in _write_files_from_queue
    stream.write(data)
OSError: [Errno 28] No space left on device: '/checkpoints/step_12000/__0_0.distcp'
torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([0])
""",
}

RENDEZVOUS_TIMEOUT = {
    "node2.log": """\
[2024-06-03 12:00:00,000] torch.distributed.elastic.rendezvous.dynamic_rendezvous: [INFO] The node 'node2_551_0' attempts to join the next round of the rendezvous 'job42'.
[2024-06-03 12:15:00,000] torch.distributed.elastic.agent.server.api: [ERROR] Error waiting on exit barrier. Elapsed: 900.1 seconds
torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError
""",
}

COLLECTIVE_MISMATCH = {
    "rank1.log": """\
[rank1]: RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=23, OpType=BROADCAST, TensorShape=[1024], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu)), but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=23, OpType=ALLREDUCE, TensorShape=[1024]).
""",
}

NAN_LOSS = {
    "train.log": """\
2024-06-03 12:00:00,000 INFO step 4811 loss 2.113 grad_norm 0.91
2024-06-03 12:00:01,000 INFO step 4812 loss 9.87 grad_norm 311.2
2024-06-03 12:00:02,000 WARNING step 4813 loss is nan, stopping
""",
}

ONLY_TIMEOUTS = {
    "rank0.log": """\
[rank0]:[E603 12:10:05.483726517 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600064 milliseconds before timing out.
""",
    "rank1.log": """\
[rank1]:[E603 12:10:06.000000000 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600064 milliseconds before timing out.
""",
}

FIRST_IN_TIME = {  # two independent causes on two ranks, minutes apart: the earlier one wins
    "rank2.log": "2024-06-03 12:05:00,000 ERROR OSError: [Errno 5] Input/output error: '/data/shard_0042.bin'\n",
    "rank6.log": "2024-06-03 12:00:00,000 ERROR [rank6]: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4096x1024 and 2048x4096)\n",
}

EXPECTED = {
    "XID79_THEN_TIMEOUTS": ("gpu_hardware", "node1-kern.log:3"),
    "OOM_ON_ONE_RANK": ("device_oom", "rank3.log:7"),
    "IB_RETRY_EXCEEDED": ("network", "rank12.log:3"),
    "KERNEL_OOM_KILL": ("host_oom", "dmesg.log:1"),
    "SHM_BUS_ERROR": ("dataloader", "train.log:2"),
    "DISK_FULL_AT_CHECKPOINT": ("storage", "rank0.log:5"),
    "RENDEZVOUS_TIMEOUT": ("rendezvous", "node2.log:3"),
    "COLLECTIVE_MISMATCH": ("collective_mismatch", "rank1.log:1"),
    "NAN_LOSS": ("numerical", "train.log:3"),
    "ONLY_TIMEOUTS": ("collective_timeout", "rank0.log:1"),
    "FIRST_IN_TIME": ("user_code", "rank6.log:1"),
}
