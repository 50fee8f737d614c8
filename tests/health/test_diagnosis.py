"""Fault diagnosis: every pattern on its excerpt, whole failed jobs, ranking rules, timestamps."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from tests.conftest import run_cli
from tests.health import logs
from trainpilot.health.diagnosis import CATEGORIES, Diagnoser, load_library
from trainpilot.health.timestamps import parse_timestamp
from trainpilot.specs.errors import SpecError

LIBRARY = load_library()
DIAGNOSER = Diagnoser(LIBRARY)


@pytest.mark.parametrize("pattern", LIBRARY.patterns, ids=lambda p: p.id)
def test_each_pattern_names_its_own_example(pattern):
    pattern_id, finding = DIAGNOSER.classify_line(pattern.example)
    assert pattern_id == pattern.id
    if pattern.id != "xid":
        assert finding.category == pattern.category


@pytest.mark.parametrize("code", sorted(LIBRARY.xid.codes))
def test_each_xid_code_is_classified_from_a_driver_line(code):
    line = f"Jun  3 12:00:07 node1 kernel: NVRM: Xid (PCI:0000:3b:00): {code}, pid=14871, name=python, Ch 00000008"
    _, finding = DIAGNOSER.classify_line(line)
    assert finding.category == LIBRARY.xid.codes[code].category
    assert f"Xid {code}" in finding.root_cause


def test_xid_line_variants_and_unlisted_codes():
    for line in ("NVRM: Xid (0000:3b:00): 48, pid=1, DBE (double bit error) ECC error",
                 "dcgm: XID 48 detected on GPU 3", "gpu 3 reported xid=48"):
        assert DIAGNOSER.classify_line(line)[1].category == "gpu_memory_ecc", line
    _, finding = DIAGNOSER.classify_line("NVRM: Xid (PCI:0000:3b:00): 999, pid=1")
    assert finding.category == "gpu_hardware" and "999" in finding.root_cause


def test_categories_are_exactly_the_issue_list():
    used = {p.category for p in LIBRARY.patterns} | {f.category for f in LIBRARY.xid.codes.values()}
    assert used == set(CATEGORIES) - {"unknown"}


@pytest.mark.parametrize("case", sorted(logs.EXPECTED))
def test_failed_jobs_are_diagnosed(case):
    category, evidence = logs.EXPECTED[case]
    result = DIAGNOSER.diagnose_texts(getattr(logs, case))
    assert result.category == category
    assert result.evidence.startswith(evidence + ": ")
    assert result.action and result.root_cause and 0 < result.confidence <= 0.99


def test_hardware_outranks_the_timeouts_it_causes_and_the_control_shows_it():
    with_kernel_log = DIAGNOSER.diagnose_texts(logs.XID79_THEN_TIMEOUTS)
    assert with_kernel_log.category == "gpu_hardware"
    assert "collective_timeout" in with_kernel_log.root_cause  # the echo is still reported
    timeouts_only = {"rank0.log": logs.XID79_THEN_TIMEOUTS["rank0.log"]}
    assert DIAGNOSER.diagnose_texts(timeouts_only).category == "collective_timeout"


def test_first_failure_in_time_wins_and_swapping_times_swaps_the_verdict():
    swapped = {name: text.replace("12:05:00", "XX").replace("12:00:00", "12:05:00")
               .replace("XX", "12:00:00") for name, text in logs.FIRST_IN_TIME.items()}
    assert DIAGNOSER.diagnose_texts(logs.FIRST_IN_TIME).category == "user_code"
    assert DIAGNOSER.diagnose_texts(swapped).category == "storage"


def test_causes_within_the_clock_skew_window_are_ranked_by_tier():
    texts = {"a.log": "2024-06-03 12:00:00,000 [rank0]: KeyError: 'input_ids'\n",
             "b.log": "2024-06-03 12:00:20,000 RuntimeError: CUDA error: uncorrectable ECC error encountered\n"}
    assert Diagnoser(skew_s=60).diagnose_texts(texts).category == "gpu_memory_ecc"
    assert Diagnoser(skew_s=0).diagnose_texts(texts).category == "user_code"


def test_peer_loss_does_not_outrank_the_crash_that_caused_it():
    texts = {"rank0.log": "2024-06-03 12:00:01,000 ncclRemoteError: remote process exited or there was a network error\n",
             "rank1.log": "2024-06-03 12:00:02,000 [rank1]: IndexError: index out of range in self\n"}
    assert DIAGNOSER.diagnose_texts(texts).category == "user_code"


def test_untimed_lines_take_the_previous_timestamp_of_their_file():
    texts = {"a.log": "2024-06-03 12:00:00,000 start\nOSError: [Errno 28] No space left on device\n",
             "b.log": "2024-06-03 11:00:00,000 start\nDataLoader worker (pid(s) 12) exited unexpectedly\n"}
    assert DIAGNOSER.diagnose_texts(texts).category == "dataloader"


def test_nothing_known_is_unknown_with_the_last_error_line():
    result = DIAGNOSER.diagnose_texts({"x.log": "all good\nsomething failed badly\nbye\n"})
    assert result.category == "unknown" and result.evidence == "x.log:2: something failed badly"
    assert result.confidence <= 0.1


_TRACEBACK = """Traceback (most recent call last):
  File "train.py", line 193, in <module>
    loss = model(batch).sum()
  File "model.py", line 40, in forward
    raise ValueError("bad config")
[rank1]: mypkg.config.ConfigValidationError: hidden_size 4095 is not divisible by 32 heads
ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 1
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_an_uncaught_exception_no_pattern_explains_is_user_code():
    result = DIAGNOSER.diagnose_texts({"r1.log": _TRACEBACK})
    assert result.category == "user_code" and 0.2 <= result.confidence <= 0.4
    # The exception itself, not the launcher's ChildFailedError after it, is the evidence.
    assert result.evidence == ("r1.log:6: [rank1]: mypkg.config.ConfigValidationError: "
                               "hidden_size 4095 is not divisible by 32 heads")
    assert "ConfigValidationError" in result.root_cause


@pytest.mark.parametrize("text", [
    # Negative controls: only a launcher's wrappers, or no exception line at all.
    "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1)\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
    "subprocess.CalledProcessError: Command '['python', 'train.py']' returned non-zero exit\n",
    "step 10 loss 2.1\nerror: something went wrong\nThe exception was logged above\n",
])
def test_no_exception_of_its_own_stays_unknown(text):
    assert DIAGNOSER.diagnose_texts({"x.log": text}).category == "unknown"


def _assert_reads(text: str, expected: str) -> None:
    """The diagnosis of ``text`` is ``expected``; "not <category>" for a negative control."""
    got = DIAGNOSER.diagnose_texts({"x.log": text}).category
    if expected.startswith("not "):
        assert got != expected[4:], got
    else:
        assert got == expected


FROM_BATCHES_49_TO_63 = [
    # bash's job line for a SIGKILLed child, posted without its "<script>: line N: " prefix.
    ("71885 Killed                  python -m kauldron.main --cfg=cfg.py\n", "host_oom"),
    # JAX's tracing errors: a concrete value asked of a traced one.
    ("jax._src.traceback_util.UnfilteredStackTrace: jax._src.errors.ConcretizationTypeError: "
     "Abstract tracer value encountered where concrete value is expected: "
     "Traced<ShapedArray(bool[], weak_type=True)>with<DynamicJaxprTrace(level=0/9)>\n", "user_code"),
    ("jax.errors.TracerBoolConversionError: Attempted boolean conversion of traced array\n",
     "user_code"),
    # Windows' ERROR_DISK_FULL text, as TensorFlow's cache writer passes it through.
    ("(0) Unknown: Failed to WriteFile: cache/training_0.data-00000-of-00001.tempstate1 : "
     "There is not enough space on the disk.\n", "storage"),
    # The TPU runtime failing to reserve HBM for an XLA program.
    ("Exception in device=TPU:6: RESOURCE_EXHAUSTED: From /job:localservice/replica:0/task:0:\n"
     "  (0) RESOURCE_EXHAUSTED: Attempting to reserve 10.51G at the bottom of memory. That was "
     "not possible. There are 8.97G free, 0B reserved, and 8.97G reservable.\n", "device_oom"),
    # A PySlowFast-style video dataset that gave up on decoding.
    ("Failed to decode by torchvision with exception: No such operator "
     "video_reader::probe_video_from_memory\n"
     "RuntimeError: Failed to fetch video after 10 retries.\n", "dataloader"),
    # nvJPEG's allocator failing inside DALI's decoder; Petastorm's stopped reader; a lambda that
    # a spawned worker cannot receive.
    ("RuntimeError: Critical error in pipeline: Error in thread 4: [nvjpeg_decoder.h:351] "
     "NVJPEG error \"5\" : NVJPEG_STATUS_ALLOCATOR_FAILURE n04418357_26036.JPEG\n", "device_oom"),
    ("Iteration on Petastorm DataLoader raise error: RuntimeError('Trying to read a sample after "
     "a reader created by make_reader/make_batch_reader has stopped.')\n", "dataloader"),
    ("Exception in main training loop: Can't pickle local object 'create.<locals>.<lambda>'\n",
     "user_code"),
    # Caffe's CUDA_CHECK, glog's CHECK_EQ on cudaErrorMemoryAllocation (2).
    ("F0110 18:01:08.005344 19573 syncedmem.cpp:51] Check failed: error == cudaSuccess (2 vs. 0)"
     "  out of memory\n*** Check failure stack trace: ***\n", "device_oom"),
    # The same glog line for another CUDA error is not an out-of-memory.
    ("F0110 18:01:08.005344 19573 math_functions.cu:79] Check failed: error == cudaSuccess "
     "(1 vs. 0)  invalid argument\n", "not device_oom"),
    # Optuna's failed-trial message carries the objective's exception as a repr; an OOM in it is
    # still an OOM.
    ("[W 2020-04-29 14:35:40,296] Setting status of trial#0 as TrialState.FAIL because of the "
     "following error: TypeError(\"'<' not supported between instances of 'Trainer' and "
     "'int'\")\n", "user_code"),
    ("[W 2023-01-01 10:00:00,000] Trial 3 failed with parameters: {'lr': 0.1} because of the "
     "following error: OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB').\n",
     "device_oom"),
    ("[I 2023-01-01 10:00:00,000] Trial 3 finished with value: 0.91 and parameters: "
     "{'lr': 0.1}. Best is trial 3 with value: 0.91.\n", "unknown"),
    # Negative controls: prose with a count and "Killed", a healthy log naming a tracer, one
    # reporting free disk space, a memory reservation that succeeded, a fetch that did, a reader
    # that was read while open, and a pickle that worked.
    ("step 10 loss 2.1\n12 Killed processes were restarted by the supervisor\n", "unknown"),
    ("step 10 loss 2.1\nINFO checked the disk: 40 GB of space free on the disk\n", "unknown"),
    ("step 10 loss 2.1\nINFO reserved 10.51G at the bottom of memory for the program\n",
     "unknown"),
    ("step 10 loss 2.1\nINFO fetched video 12 after 2 retries\nstep 11 loss 2.0\n", "unknown"),
    ("step 10 loss 2.1\nINFO Petastorm reader created by make_reader, 12 row groups\n", "unknown"),
    ("step 10 loss 2.1\nINFO pickled local object cache to /tmp/cache.pkl\n", "unknown"),
    ("step 10 loss 2.1\nINFO tracing the function train_step for jit\nstep 11 loss 2.0\n",
     "unknown"),
]


FROM_BATCHES_66_TO_76 = [
    # TensorFlow's allocator (batches 66 and 67), with the device named; the BFC allocator's
    # warning that the caller survives is no failure, and a CPU tensor is not device memory.
    ("[1,1]<stderr>:tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when "
     "allocating tensor with shape[2,1023,50257] and type float on "
     "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc\n", "device_oom"),
    ("W tensorflow/core/common_runtime/bfc_allocator.cc:275] Ran out of memory trying to allocate "
     "7.69MiB.  See logs for memory state.\n", "device_oom"),
    ("W tensorflow/core/common_runtime/bfc_allocator.cc:239] Allocator (GPU_0_bfc) ran out of "
     "memory trying to allocate 3.46GiB with freed_by_count=0. The caller indicates that this is "
     "not a failure, but may mean that there could be performance gains if more memory were "
     "available.\nEpoch 1/10\n", "unknown"),
    ("W op_kernel.cc:1273] Resource exhausted: OOM when allocating tensor with shape[1024,50257] "
     "and type float on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu\n",
     "not device_oom"),
    # A zero-padded NaN loss (Python's format), and the space before "=" (batch 66).
    ("Step      60 (19.23%): loss = 3.09014 EER=0.17402\n"
     "Step      80 (23.64%): loss = 0000nan EER=0.00000\n", "numerical"),
    ("epoch 3 step 200 loss = nan\n", "numerical"),
    ("epoch 3 step 200 loss = 0000.5 lr = 0.0001\nepoch 3 step 201 loss = 0000.4\n", "unknown"),
    # Lua Torch's short write while saving (batch 67).
    ("lua: .../torch/File.lua:210: write error: wrote 24686288 blocks instead of 32768000 at "
     ".../TH/THDiskFile.c:353\n", "storage"),
    ("Epoch: [20][ 3 / 3] Err_G: 1.69 wrote 3 blocks of images to disk\n", "unknown"),
    # TensorFlow's collective gather with members of different shapes (batch 69).
    ("W tensorflow/core/framework/op_kernel.cc:1622] OP_REQUIRES failed at collective_ops.cc:125 "
     ": Internal: [_Derived_]Inconsistent output shapes, got [16], but expected is [64].\n",
     "collective_mismatch"),
    ("WARNING: inconsistent output shapes across eval shards, padding to [64]\nstep 10 loss 2.1\n",
     "unknown"),
    # DyNet's non-finite gradient norm and Opacus's unsupported module (batches 70 and 71).
    ('  File "_dynet.pyx", line 5733, in _dynet.Trainer.update\n'
     "RuntimeError: Magnitude of gradient is bad: -nan\n", "numerical"),
    ("[epoch=3 clips=84 updates=100] magnitude of gradient is bad: 12.5 (clipped)\n", "unknown"),
    (" [NotImplementedError('grad sampler is not yet implemented for BatchNorm2d(64, eps=1e-05, "
     "momentum=0.1, affine=True, track_running_stats=True)'),\n", "user_code"),
    ("INFO opacus: grad sampler registered for Linear, Conv2d, GroupNorm\nstep 10 loss 2.1\n",
     "unknown"),
    # Ray 1.x's memory monitor, NumPy's NaN probabilities and Leela Zero's curl (batch 75).
    ("ray.memory_monitor.RayOutOfMemoryError: More than 95% of the memory on node tr001 is used "
     "(59.62 / 62.75 GB). The top 10 memory consumers are:\n", "host_oom"),
    ("INFO memory_monitor: 41% of the memory on node tr001 is used (25.7 / 62.75 GB)\n", "unknown"),
    ('  File "mtrand.pyx", line 920, in numpy.random.mtrand.RandomState.choice\n'
     "ValueError: probabilities contain NaN\n", "numerical"),
    ("ValueError: probabilities do not sum to 1\n", "not numerical"),
    ("NetworkException: Curl returned non-zero exit code 18\n", "network"),
    ("Got new job: selfplay\nCurl returned exit code 0, network downloaded\n", "unknown"),
    # Lua Torch's CPU allocator and dmlc-core's short write (batch 76).
    ("torch/install/share/lua/5.1/nn/THNN.lua:109: $ Torch: not enough memory: you tried to "
     "reallocate 11GB. Buy new RAM! at torch7/lib/TH/THGeneral.c:251\n", "host_oom"),
    ("[16:24:41] src/io/local_filesys.cc:39: Check failed: std::fwrite(ptr, 1, size, fp_) == "
     "size FileStream.Write incomplete\n", "storage"),
    ("INFO FileStream.Write complete: 1204 bytes\nEpoch[3] Batch [200] Speed: 812 samples/sec\n",
     "unknown"),
]


FROM_FRAMEWORK_SOURCES = [
    # Written from the frameworks' sources, not from any case (docs/health.md, batches 64-67).
    ("mxnet.base.MXNetError: [23:54:01] src/storage/./pooled_storage_manager.h:161: cudaMalloc "
     "retry failed: out of memory\n", "device_oom"),
    ("MemoryError: Error allocating 1258291200 bytes of device memory "
     "(CNMEM_STATUS_OUT_OF_MEMORY).\n", "device_oom"),
    ("Error allocating 422125568 bytes of device memory (an illegal memory access was "
     "encountered). Driver report 0 bytes free and 0 bytes total\n", "not device_oom"),
    ("RuntimeError: Device(id:0) memory isn't enough and alloc failed, kernel name: "
     "Default/network-WithLossCell, alloc size: 1073741824B.\n", "device_oom"),
    ("Resource exhausted: OOM when allocating tensor with shape[1024,50257] and type float on "
     "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu\n", "host_oom"),
    ("tensorflow.python.framework.errors_impl.InvalidArgumentError: LossTensor is inf or nan : "
     "Tensor had NaN values\n", "numerical"),
    ("InvalidArgumentError: Nan in summary histogram for: dense/kernel_0\n", "numerical"),
    ("mpirun noticed that process rank 1 with PID 0 on node node01 exited on signal 9 "
     "(Killed).\n", "host_oom"),
    ("mpirun noticed that process rank 1 with PID 0 on node node01 exited on signal 11 "
     "(Segmentation fault).\n", "not host_oom"),
    ("INFO:tensorflow:global_step/sec: 3.2\nINFO:tensorflow:Saving dict for global step 400: "
     "summary histogram for dense/kernel_0 written, tensor had 0 NaN checks enabled\n", "unknown"),
]


FROM_BATCHES_78_ON = [
    # Written from authoring misses of the batches collected under the definitions (docs/health.md).
    ("ERROR: LoadError: Out of GPU memory trying to allocate 21.000 MiB\nEffective GPU memory "
     "usage: 99.73% (7.772 GiB/7.793 GiB)\n", "device_oom"),
    ("# 50 million runs out of GPU memory, so the batch was halved\n", "unknown"),
    ("libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command "
     "buffer execution failed: Insufficient Memory "
     "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)\n", "device_oom"),
    ("RuntimeError: [metal::malloc] Attempting to allocate 134668044288 bytes which is greater "
     "than the maximum allowed buffer size of 86586540032 bytes.\n", "device_oom"),
    ("libc++abi: terminating due to uncaught exception of type std::runtime_error: [METAL] Command "
     "buffer execution failed: Caused GPU Timeout Error "
     "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)\n", "not device_oom"),
    ("\u26a0 Aborting and saving the final best model. Encountered exception:\n"
     "OutOfMemoryError('Out of memory allocating 3,327,510,528 bytes (allocated so\n"
     "far: 13,736,083,968 bytes).',)\n", "device_oom"),
    ("malloc: Out of memory allocating 4096 bytes of scratch\n", "not device_oom"),
    ("2018-05-08 11:13:52.489906: W tensorflow/core/common_runtime/bfc_allocator.cc:273] "
     "Allocator (GPU_0_bfc) ran out of memory trying to allocate 27.56MiB.  Current allocation "
     "summary follows.\n", "device_oom"),
    ("2020-02-07 18:28:12.016577: W tensorflow/core/common_runtime/bfc_allocator.cc:419] "
     "Allocator (GPU_0_bfc) ran out of memory trying to allocate 26.59MiB (rounded to "
     "27878400).  Current allocation summary follows.\n", "device_oom"),
    ("RuntimeError: Resource exhausted: Out of memory while trying to allocate 15273920000 "
     "bytes.\n", "device_oom"),
    ("gdbserver: ran out of memory while trying to allocate 4096 bytes\n", "not device_oom"),
    ("RuntimeError: normal expects all elements of std >= 0.0\n", "numerical"),
    ("RuntimeError: normal expects std >= 0.0, but found std -1\n", "not numerical"),
    ("GpuContext::Startup: Process 0 out of 1 initialized.\ncudaGetDeviceCount failed CUDA driver "
     "version is insufficient for CUDA runtime version\n", "user_code"),
    ("| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2     |\n",
     "unknown"),
    ("spm_train_main.cc(171) [!absl::GetFlag(FLAGS_model_prefix).empty()] \nProgram terminated "
     "with an unrecoverable error.\n", "user_code"),
    ("trainer_interface.cc(409) LOG(INFO) Loaded all 1000000 sentences\n", "unknown"),
    ("Error: YamlValidationException: Failed to validate YAML. Please make sure the file is "
     "correct and all mandatory parameters are specified.\n  in Line 3:\n      Value "
     "'b'spacy_sklearn'' is not a list. Value path: '/pipeline'\n", "user_code"),
    ("INFO  rasa.validator - Validating intents...\nINFO  rasa.validator - Validating "
     "utterances...\n", "unknown"),
    ("Building model...\n...Done.\nTraining model...\n[1]    2843557 killed\n", "host_oom"),
    ("[1] 2843557\n[1]  + 2843557 done       python train.py\n", "unknown"),
]

# Each pattern written this way meets its message and look-alikes that must not match it.
@pytest.mark.parametrize("text, expected",
                         FROM_BATCHES_49_TO_63 + FROM_BATCHES_66_TO_76 + FROM_FRAMEWORK_SOURCES +
                         FROM_BATCHES_78_ON)
def test_patterns_read_their_messages_and_not_their_look_alikes(text, expected):
    _assert_reads(text, expected)


def test_a_matched_pattern_outranks_the_exception_fallback():
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "RuntimeError: something else\n")
    assert DIAGNOSER.diagnose_texts({"x.log": text}).category == "device_oom"


@pytest.mark.parametrize("line, expected", [
    ("2024-06-03 12:00:05,123 INFO x", datetime(2024, 6, 3, 12, 0, 5, 123000)),
    ("2024-06-03T12:00:05.5+02:00 x", datetime(2024, 6, 3, 10, 0, 5, 500000)),
    ("[2024-06-03 12:00:05,000] torch.distributed.elastic", datetime(2024, 6, 3, 12, 0, 5)),
    ("[rank0]:[E603 12:00:05.483726517 ProcessGroupNCCL.cpp:632] x", datetime(2024, 6, 3, 12, 0, 5, 483726)),
    ("E0603 12:00:05.000001 140 api.py:869] failed", datetime(2024, 6, 3, 12, 0, 5, 1)),
    ("[Mon Jun  3 12:00:05 2024] Out of memory", datetime(2024, 6, 3, 12, 0, 5)),
    ("Jun  3 12:00:05 node1 kernel: NVRM: Xid", datetime(2024, 6, 3, 12, 0, 5)),
    ("2024/06/03 12:00:05 x", datetime(2024, 6, 3, 12, 0, 5)),
    ("[ 1832210.554420] NVRM: Xid (PCI:0000:3b:00): 79", None),  # seconds since boot: no clock
    ("node4:771:2263 [4] NCCL WARN x", None),
])
def test_timestamp_formats(line, expected):
    assert parse_timestamp(line, default_year=2024) == expected


def test_a_bad_pattern_library_is_a_spec_error(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("categories: {}\nxid: {default: {category: gpu_hardware, confidence: 0.5, "
                    "root_cause: r, action: a}, codes: {}}\npatterns:\n"
                    "  - {id: a, category: network, regex: '(', confidence: 0.5, root_cause: r, "
                    "action: a, example: e}\n")
    with pytest.raises(SpecError, match="regex"):
        load_library(path)
    path.write_text(path.read_text().replace("regex: '('", "regex: 'x', colour: red"))
    with pytest.raises(SpecError, match="colour"):
        load_library(path)


def test_cli_json_has_exactly_the_documented_keys(tmp_path):
    files = []
    for name, text in logs.XID79_THEN_TIMEOUTS.items():
        (tmp_path / name).write_text(text)
        files.append(str(tmp_path / name))
    result = run_cli("diagnose", *files, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"category", "root_cause", "evidence", "action", "confidence", "rank",
                         "node"}
    assert data["category"] == "gpu_hardware" and "fallen off the bus" in data["evidence"]
    assert data["node"] == "node1"  # the kernel log's syslog host field


def test_cli_records_the_diagnosis_in_a_store_and_reports_missing_files(tmp_path):
    from trainpilot.store import RunStore

    log = tmp_path / "rank0.log"
    log.write_text(logs.DISK_FULL_AT_CHECKPOINT["rank0.log"])
    result = run_cli("diagnose", str(log), "--store", str(tmp_path / "run"))
    assert result.returncode == 2 and "run_dir" in result.stderr  # a typo creates nothing
    assert not (tmp_path / "run").exists()
    RunStore.create(tmp_path / "run", name="r").close(status="failed")
    result = run_cli("diagnose", str(log), "--store", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "storage" in result.stdout
    store = RunStore.open_readonly(tmp_path / "run")
    assert store.knowledge("storage")[0]["outcome"] == "diagnosed"
    assert store.events(kinds=["diagnosis"])[0].name == "storage"
    missing = run_cli("diagnose", str(tmp_path / "nope.log"))
    assert missing.returncode == 2 and "LOGFILE" in missing.stderr
    assert "Traceback" not in missing.stderr
