"""Diagnosis input and the rules beyond single-line patterns: word-bounded triggers, rank and
node, compressed and bad files, streaming chunks, metric-line rules, the real-log corpus."""

from __future__ import annotations

import bz2
import gzip
import lzma
import math
import re

import pytest

from tests.conftest import run_cli
from tests.health import logs
from trainpilot.health.diagnosis import Diagnoser, load_library, locate
from trainpilot.health.logscan import Prefilter, iter_chunks, open_log, text_chunks
from trainpilot.specs.errors import SpecError

LIBRARY = load_library()
DIAGNOSER = Diagnoser(LIBRARY)
DEFAULT_LINE = "[default3]:[rank3]: ValueError: error in the default tokenizer config"


def test_efa_needs_a_word_and_the_old_pattern_fails_the_same_check():
    # torchelastic prefixes every line with [defaultN]: ("d-efa-ult"); a line with "error".
    assert DIAGNOSER.diagnose_texts({"r3.log": DEFAULT_LINE + "\n"}).category == "user_code"
    assert DIAGNOSER.classify_line("NCCL WARN NET/OFI EFA error: peer unreachable")[0] in (
        "efa_ofi_error",)
    # Negative control: the pattern as it was (no word boundary) calls the line a network fault.
    old = re.compile(r"NET/OFI.*(?:error|failed)|fi_cq_readerr|EFA.*(?:error|unreachable)", re.I)
    assert old.search(DEFAULT_LINE)


def test_every_pattern_example_survives_the_prefilter():
    prefilter = Prefilter(t for p in LIBRARY.patterns for t in p.trigger_list())
    for p in LIBRARY.patterns:
        text = "step 1 loss 3.2\n" + p.example + "\nstep 2 loss 3.1\n"
        spans = prefilter.line_spans(text.lower())
        assert any(text[a:b] == p.example for a, b in spans), p.id
    # A line with no trigger is never looked at.
    assert prefilter.line_spans("step 1 loss 3.2 lr 3e-4 grad_norm 0.8\n") == []


def test_the_prefilter_tells_the_metric_rules_which_literals_a_chunk_holds():
    # The metric rules skip a chunk without "overflow" / "skipped=" on the prefilter's word
    # instead of scanning 8 MB twice more; the answer must equal a plain `in`, also where a
    # short trigger dropped for want of a word boundary ("eio" in "eioverflow") overlaps one.
    from trainpilot.health.metriclines import PRESENCE_LITERALS

    prefilter = DIAGNOSER._prefilter
    texts = [b"step 1 loss 3.2\nfoo eioverflow bar\n", b"step 1 loss 3.2\n" * 50,
             b"[deepspeed] OVERFLOW! Rank 0 Skipping step.\n".lower(),
             b"step=100, skipped=3, lr=[0.0003]\n", b"x=nanskipped=1\n"]
    seen = set()
    for text in texts:
        dropped: list[tuple[int, int]] = []
        spans = prefilter.line_spans(text, dropped=dropped)
        held = prefilter.held(text, PRESENCE_LITERALS, spans + dropped)
        for lit in PRESENCE_LITERALS:
            assert (lit in held) == (lit in text), (text, lit)
            seen.add(lit in text)
        assert not dropped or text.startswith(b"step 1 loss 3.2\nfoo eio")
    assert seen == {True, False}  # both answers occur
    # Negative control: without the dropped hits' lines, the hidden literal is missed.
    text = texts[0]
    dropped = []
    spans = prefilter.line_spans(text, dropped=dropped)
    assert dropped and b"overflow" not in prefilter.held(text, [b"overflow"], spans)


@pytest.mark.parametrize("line, file, rank, node", [
    ("[rank3]:[E603 12:10:05.48 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught", "x.log", 3, None),
    ("node4:771:2263 [4] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion", "a.log", None, "node4"),
    ("Jun  3 12:00:07 gpu-node17 kernel: NVRM: Xid (PCI:0000:3b:00): 79", "kern.log", None, "gpu-node17"),
    ("[default5]:RuntimeError: CUDA error: an illegal memory access", "job.err", 5, None),
    ("RuntimeError: CUDA out of memory.", "logs/rank12.log", 12, None),
    ("local_rank: 3 (pid: 90211) of binary", "launcher.log", 3, None),
])
def test_rank_and_node_of_the_evidence(line, file, rank, node):
    assert locate(line, file) == (rank, node)


def test_the_verdict_names_the_failing_rank():
    result = DIAGNOSER.diagnose_texts(logs.OOM_ON_ONE_RANK)
    assert result.category == "device_oom" and result.rank == 3


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress, "zstd"])
def test_compressed_logs_read_like_plain_ones(tmp_path, compress):
    text = logs.OOM_ON_ONE_RANK["rank3.log"]
    plain = tmp_path / "rank3.log"
    plain.write_text(text)
    if compress == "zstd":
        import zstandard

        data = zstandard.ZstdCompressor().compress(text.encode())
    else:
        data = compress(text.encode())
    packed = tmp_path / "rank3.log.packed"  # the magic bytes decide, not the name
    packed.write_bytes(data)
    a, b = DIAGNOSER.diagnose_files([plain]), DIAGNOSER.diagnose_files([packed])
    assert a.category == b.category == "device_oom"
    assert a.evidence.split(":", 1)[1] == b.evidence.split(":", 1)[1]


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress])
def test_a_compressed_log_cut_short_is_diagnosed_up_to_the_cut_with_a_warning(tmp_path, compress):
    # 3 MB of step lines, the OOM, 3 MB more; the file is cut at 70 % of its compressed bytes
    # (a log compressed while the job died). Before: a traceback from inside the decompressor.
    def steps(first: int) -> str:
        return "".join(f"step {i} loss 2.{i % 997:03d} lr 3e-4 tok/s {5000 + i % 89}\n"
                       for i in range(first, first + 75_000))

    text = steps(0) + logs.OOM_ON_ONE_RANK["rank3.log"] + steps(75_000)
    data = compress(text.encode())
    cut = tmp_path / "rank3.log.gz"
    cut.write_bytes(data[:int(len(data) * 0.7)])
    result = DIAGNOSER.diagnose_files([cut])
    assert result.category == "device_oom"
    assert len(result.warnings) == 1 and "ends early or is corrupt" in result.warnings[0]
    cli = run_cli("diagnose", "--json", str(cut))
    assert cli.returncode == 0 and "Traceback" not in cli.stderr
    assert "warning:" in cli.stderr and "device_oom" in cli.stdout
    # Control: the whole file gives the same verdict and no warning.
    whole = tmp_path / "whole.log.gz"
    whole.write_bytes(data)
    assert DIAGNOSER.diagnose_files([whole]).warnings == ()


@pytest.mark.parametrize("data, why", [
    (b"", "empty"), (b"   \n\n", "empty"), (gzip.compress(b"", mtime=0), "empty"),
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8, "binary"),
    (gzip.compress(bytes(range(256)) * 40, mtime=0), "binary"),
    (b"\x1f\x8b\x08\x00 truncated gzip", "readable gzip"),
])
def test_empty_binary_and_corrupt_files_are_bad_input(tmp_path, data, why):
    path = tmp_path / "x.log"
    path.write_bytes(data)
    with pytest.raises(SpecError, match=why):
        open_log(path)
    result = run_cli("diagnose", str(path))
    assert result.returncode == 2 and why in result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_utf8_is_read_with_replacement(tmp_path):
    path = tmp_path / "x.log"
    path.write_bytes(b"caf\xe9 \xff\n" + logs.OOM_ON_ONE_RANK["rank3.log"].encode())
    assert DIAGNOSER.diagnose_files([path]).category == "device_oom"


def test_chunks_do_not_change_matches_or_line_numbers(tmp_path):
    text = "".join(f"step {i} loss {3 + 1 / (i + 1):.4f}\n" for i in range(3000))
    text += "RuntimeError: CUDA error: out of memory\n" + "bye\n" * 50
    text += "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"
    path = tmp_path / "big.log"
    path.write_text(text)
    whole, _ = DIAGNOSER.scan_chunks("big.log", text_chunks(text))
    stream, _ = open_log(path)
    small, _ = DIAGNOSER.scan_chunks("big.log", iter_chunks(stream, chunk_bytes=4096))
    stream.close()
    assert [(m.line_no, m.pattern_id) for m in whole] == [(m.line_no, m.pattern_id)
                                                          for m in small]
    assert [m.line_no for m in whole] == [3001, 3052]


# ------------------------------------------------------------------ metric-line rules
def _steps(values, fmt="iter {i}: loss {v}, time 1019.95ms, mfu 14.12%"):
    return "".join(fmt.format(i=i, v=v) + "\n" for i, v in enumerate(values))


def test_nan_in_metric_fields_is_numerical_with_the_first_line():
    text = _steps([4.1, 4.0, 3.9, "nan", "nan"])
    result = DIAGNOSER.diagnose_texts({"train.log": text})
    assert result.category == "numerical" and result.evidence.startswith("train.log:4: ")
    for line in ("step 40 | lm loss: 2.3E+00 | grad norm: nan |",
                 "[titan] step: 12 loss: 3.12 grad_norm=nan memory: 36GiB",
                 "{'loss': 'inf', 'learning_rate': 3e-05}",
                 "train_batch_loss[ 6590 ]:  nan"):
        assert DIAGNOSER.diagnose_texts({"a.log": line + "\n"}).category == "numerical", line
    # A loss indexed by its step is part of the loss series; a finite one is no failure.
    indexed = _steps([4.1, 4.0, 3.9], fmt="train_batch_loss[ {i} ]:  {v}")
    assert DIAGNOSER.diagnose_texts({"a.log": indexed}).category == "unknown"
    assert DIAGNOSER.diagnose_texts({"a.log": indexed + "train_batch_loss[ 3 ]:  nan\n"}
                                    ).evidence.startswith("a.log:4: ")
    # Negative controls: "nan" and "inf" elsewhere (NCCL INFO, nanoGPT's name) are not a NaN.
    clean = _steps([4.1, 4.0, 3.9]) + "NCCL INFO nanogpt init done\ninfo: loss 3.8 nano\n"
    assert DIAGNOSER.diagnose_texts({"a.log": clean}).category == "unknown"


def test_a_loss_spike_in_metric_lines_is_found_and_noise_is_not():
    rng = __import__("random").Random(0)
    losses = [3.0 - 0.005 * i + 0.05 * rng.random() for i in range(200)]
    spiky = list(losses)
    spiky[150] = 9.0
    result = DIAGNOSER.diagnose_texts({"t.log": _steps([f"{v:.4f}" for v in spiky])})
    assert result.category == "numerical" and result.evidence.startswith("t.log:151: ")
    assert "spike" in result.root_cause
    # Negative control: the same curve without the spike; and early high losses (warm-up).
    assert DIAGNOSER.diagnose_texts({"t.log": _steps([f"{v:.4f}" for v in losses])}
                                    ).category == "unknown"
    warm = [10 / (i + 1) + 2 for i in range(200)]
    assert DIAGNOSER.diagnose_texts({"t.log": _steps([f"{v:.4f}" for v in warm])}
                                    ).category == "unknown"


@pytest.mark.parametrize("drop, expected", [(0.06, "straggler"), (0.02, "unknown"),
                                            (0.0, "unknown")])
def test_throughput_drift_in_metric_lines(drop, expected):
    rng = __import__("random").Random(1)
    n = 400
    lines = "".join(f"step {i} loss 3.1 tokens/s {6000 * (1 - drop * i / n) * (1 + 0.01 * rng.gauss(0, 1)):.0f}\n"
                    for i in range(n))
    result = DIAGNOSER.diagnose_texts({"t.log": lines})
    assert result.category == expected, result.root_cause


def _ds_overflow(attempted, new, sec):
    # deepspeed/runtime/fp16/loss_scaler.py (update_scale)'s message, as logger.info prints it.
    return (f"[2024-06-03 12:{sec // 60:02d}:{sec % 60:02d},000] [INFO] [loss_scaler.py:183:"
            f"update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: "
            f"{attempted}, reducing to {new}\n")


def _fairseq_overflow(scale, sec):
    # fairseq/trainer.py logs the OverflowError of fairseq/optim/dynamic_loss_scaler.py.
    return (f"2024-06-03 12:{sec // 60:02d}:{sec % 60:02d} | INFO | fairseq.trainer | NOTE: "
            f"gradient overflow detected, ignoring gradient, setting loss scale to: {scale}\n")


def _megatron(it, scale, skipped, nan=0):
    # megatron/training/training.py (training_log)'s iteration line.
    return (f" iteration {it:8d}/  500000 | consumed samples: {it * 512:12d} | elapsed time per "
            f"iteration (ms): 4247.9 | learning rate: 3.000000E-04 | global batch size:   512 | "
            f"lm loss: 2.381234E+00 | loss scale: {scale:.1f} | grad norm: 0.812 | number of "
            f"skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |\n")


def test_repeated_loss_scale_overflow_is_numerical_and_calibration_is_not():
    # DeepSpeed at start-up halves the scale from 2**32 many times: normal, not a failure.
    calibration = "".join(_ds_overflow(2 ** (32 - i), 2 ** (31 - i), i) for i in range(16))
    assert DIAGNOSER.diagnose_texts({"a.log": calibration}).category == "unknown"
    # The scaler at its floor and still overflowing: the step DeepSpeed raises on next time.
    floor = calibration + _ds_overflow(1, 1, 100)
    result = DIAGNOSER.diagnose_texts({"a.log": floor})
    assert result.category == "numerical" and result.evidence.startswith("a.log:17: ")
    assert "minimum" in result.root_cause
    # fairseq: back-offs to 2 and 1 then training goes on (fairseq's own FSDP example log): fine.
    healthy = _fairseq_overflow(2.0, 1) + _fairseq_overflow(1.0, 2)
    assert DIAGNOSER.diagnose_texts({"a.log": healthy}).category == "unknown"
    # Three back-offs in a row that take the scale below 1: the overflow is not going away.
    collapse = "".join(_fairseq_overflow(2.0 ** (1 - i), i) for i in range(5))
    result = DIAGNOSER.diagnose_texts({"a.log": collapse})
    assert result.category == "numerical" and result.evidence.startswith("a.log:3: ")
    # apex amp's message, same rule.
    apex = "".join(f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to "
                   f"{2.0 ** (2 - i)}\n" for i in range(6))
    assert DIAGNOSER.diagnose_texts({"a.log": apex}).category == "numerical"
    # A growth between back-offs breaks the run: 0.5 -> 0.25, regrown, 0.5 -> 0.25 ... is no streak.
    regrown = "".join(_ds_overflow(a, n, i) for i, (a, n) in
                      enumerate([(1.0, 0.5), (0.5, 0.25), (0.5, 0.25), (0.5, 0.25)]))
    assert DIAGNOSER.diagnose_texts({"a.log": regrown}).category == "unknown"


def test_deepspeed_skipped_steps_and_megatron_floor_lines():
    progress = "".join(f"[2024-06-03 12:{i:02d}:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] "
                       f"step={i * 100}, skipped={{}}, lr=[0.0001], mom=[(0.9, 0.999)]\n"
                       for i in range(1, 11))
    healthy = progress.format(*[min(20, 10 * i) for i in range(1, 11)])
    assert DIAGNOSER.diagnose_texts({"a.log": healthy}).category == "unknown"
    failing = progress.format(*[20, 20, 20, 20, 20, 100, 180, 260, 340, 420])
    result = DIAGNOSER.diagnose_texts({"a.log": failing})
    assert result.category == "numerical" and result.evidence.startswith("a.log:6: ")
    # Megatron-LM: bf16 runs print loss scale 1.0 with nothing skipped (negative control); fp16
    # start-up skips at high scales; at the floor (1.0) and still skipping is a collapse.
    bf16 = "".join(_megatron(10 * i, 1.0, 0) for i in range(1, 30))
    start = "".join(_megatron(10 * i, 2.0 ** (30 - i) if i < 5 else 65536.0, 3 if i < 5 else 0)
                    for i in range(1, 30))
    assert DIAGNOSER.diagnose_texts({"a.log": bf16}).category == "unknown"
    assert DIAGNOSER.diagnose_texts({"a.log": start}).category == "unknown"
    floor = start + _megatron(300, 1.0, 10) + _megatron(310, 1.0, 10)
    result = DIAGNOSER.diagnose_texts({"a.log": floor})
    assert result.category == "numerical" and result.evidence.startswith("a.log:31: ")
    # Its NaN-iteration counter: 0 is healthy, >= 1 means the loss itself was NaN/inf.
    nan = bf16 + _megatron(300, 1.0, 2, nan=2)
    result = DIAGNOSER.diagnose_texts({"a.log": nan})
    assert result.category == "numerical" and result.evidence.startswith("a.log:30: ")


def test_a_megatron_line_without_its_loss_is_a_nan_and_an_moe_line_is_not():
    # training_log prints a loss only "if avg >= 0.0": a NaN loss leaves no field at all.
    healthy = "".join(_megatron(10 * i, 1.0, 0) for i in range(1, 30))
    dropped = healthy + _megatron(300, 1.0, 0).replace("lm loss: 2.381234E+00 | ", "")
    result = DIAGNOSER.diagnose_texts({"a.log": dropped})
    assert result.category == "numerical" and result.evidence.startswith("a.log:30: ")
    assert DIAGNOSER.diagnose_texts({"a.log": healthy}).category == "unknown"
    # An MoE run: its load-balancing loss sits between the batch size and the loss scale.
    moe = healthy.replace("lm loss: 2.381234E+00 | ", "lm loss: 2.381234E+00 | "
                          "load_balancing_loss: 1.012300E+00 | ")
    assert DIAGNOSER.diagnose_texts({"a.log": moe}).category == "unknown"


def test_loss_is_infinity_and_fairseq_scale_at_zero_are_numerical():
    # BigDL/Java-style "Loss is Infinity." and fairseq's "| loss_scale 0.000 |" progress field.
    line = ("[Epoch 64 740096/1281167][Iteration {i}] Train 1792 in 4.0 seconds. Throughput is "
            "447.2 records/second. Loss is {v}. Current learning rate is 0.046.\n")
    good = "".join(line.format(i=i, v=1.26) for i in range(30))
    assert DIAGNOSER.diagnose_texts({"a.log": good}).category == "unknown"
    bad = good + line.format(i=30, v="Infinity")
    assert DIAGNOSER.diagnose_texts({"a.log": bad}).category == "numerical"
    table = ("| epoch 028 | loss 3.976 | nll_loss 2.204 | ppl 4.61 | num_updates 9165 | lr "
             "0.000330319 | gnorm 0.635 | clip 0.000 | oom 0.000 | loss_scale {} | wall 4043\n")
    assert DIAGNOSER.diagnose_texts({"a.log": table.format("8.000")}).category == "unknown"
    assert DIAGNOSER.diagnose_texts({"a.log": table.format("0.000")}).category == "numerical"


def test_a_suffixed_loss_field_is_read_for_nan_and_the_loss_scale_is_not_a_loss():
    bar = ("Epoch 3:  45%|####5     | 450/1000 [01:23<01:40,  5.40it/s, v_num=0, "
           "train_loss_step={}]\n")
    assert DIAGNOSER.diagnose_texts({"a.log": bar.format("nan")}).category == "numerical"
    assert DIAGNOSER.diagnose_texts({"a.log": bar.format("0.412")}).category == "unknown"
    assert DIAGNOSER.diagnose_texts({"a.log": '{"loss_scale": "inf"}\n'}).category == "unknown"


def test_the_metric_gates_stay_open_wherever_their_rules_match():
    # A healthy chunk skips three regex scans when the gates stay shut ("of nan iterations",
    # "INFO", "iterations:   0" on every line); they must open wherever a rule would match.
    from trainpilot.health import metriclines as ml

    fields = [b"grad norm: nan |", b"'grad_norm': inf,", b"norm=infinity\n", b"norm\n nan",
              b"train_loss_step=nan]", b"loss_avg: -inf ", b"norm: +infinity"]
    counters = [b"number of skipped iterations:   3 |", b"number of nan iterations:  12 |"]
    healthy = (b"node1 NCCL INFO Channel 00/0 | number of skipped iterations:   0 | number of nan "
               b"iterations:   0 | grad norm: 0.227 | nanoseconds 12 | inference info\n")
    for text in fields + counters:
        expected = (bool(ml.GRAD_NONFINITE.search(text) or ml.LOSS_SUFFIX_NONFINITE.search(text)),
                    bool(ml.MEGATRON_COUNTS.search(text)))
        assert expected == (text in fields, text in counters), text
        for chunk in (text, healthy + text, text + b"\n" + healthy):
            assert ml._gates(chunk) == expected, chunk
    assert ml._gates(healthy * 50) == (False, False)
    # Negative control: an inf gate without "inity" stays shut on "norm=infinity".
    old = ml._GATES
    try:
        ml._GATES = re.compile(rb"n(?:an(?![a-z0-9])(?<!of nan)|f(?<=inf)(?![a-z0-9]))")
        assert ml._gates(b"norm=infinity\n") == (False, False)
    finally:
        ml._GATES = old


def test_count_newlines_is_bytes_count_across_blocks():
    from trainpilot.health.logscan import COUNT_BLOCK_BYTES, count_newlines

    data = b"".join(b"x" * (i % 97) + b"\n" for i in range(20000))
    assert len(data) > 2 * COUNT_BLOCK_BYTES
    for start, end in ((0, None), (0, len(data)), (5, COUNT_BLOCK_BYTES + 7), (1000, 1100),
                       (COUNT_BLOCK_BYTES - 1, 3 * COUNT_BLOCK_BYTES), (len(data), None), (9, 3)):
        assert count_newlines(data, start, end) == data.count(b"\n", start, end)


def test_stack_dumps_in_collectives_are_a_hang_but_tracebacks_are_not():
    # py-spy dump ("    name (file:line)") and faulthandler ('File "f", line N in name').
    for line in ("    barrier (torch/distributed/distributed_c10d.py:4166)",
                 '  File "/opt/conda/lib/python3.10/site-packages/torch/distributed/'
                 'distributed_c10d.py", line 2501 in all_reduce',
                 "#4  0x00007f3a6c2b1d4e in bootstrapAllGather (commState=0x55d1c0, allData=0x7f,"
                 " size=64) at bootstrap.cc:1052"):
        assert DIAGNOSER.diagnose_texts({"a.log": line + "\n"}).category == "hang", line
    # Negative controls: an exception's traceback frame (", in"), NCCL's own INFO lines.
    for line in ('  File "/opt/conda/lib/python3.10/site-packages/torch/distributed/'
                 'distributed_c10d.py", line 2501, in all_reduce',
                 "node1:1234:1300 [0] NCCL INFO ncclCommInitRank comm 0x55d1c0 rank 0 nranks 16 "
                 "cudaDev 0 busId 18000 commId 0x6c1a - Init COMPLETE",
                 "node1:1234:1234 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>",
                 "node1:1234:1300 [0] NCCL INFO Channel 00/0 : 0[0] -> 2[2] via P2P/IPC"):
        assert DIAGNOSER.diagnose_texts({"a.log": line + "\n"}).category == "unknown", line


HEALTHY_JOB = """\
node1:1234:1234 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
node1:1234:1300 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.1<0>
node1:1234:1300 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
node1:1234:1300 [0] NCCL INFO Trees [0] 1/8/-1->0->-1 [1] 1/-1/-1->0->8
node1:1234:1300 [0] NCCL INFO ncclCommInitRank comm 0x55d1c0 rank 0 nranks 16 cudaDev 0 busId 18000 \
commId 0x6c1a - Init COMPLETE
[2024-06-03 12:00:18,030] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 \
Skipping step. Attempted loss scale: 65536, reducing to 32768
[2024-06-03 12:00:19,030] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! Rank 0 \
Skipping step. Attempted loss scale: 32768, but hysteresis is 2. Reducing hysteresis to 1
[2024-06-03 12:01:05,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=20, skipped=3, lr=[0.0001]
{'loss': 0.4123, 'grad_norm': 1.53, 'learning_rate': 9.9e-06, 'epoch': 0.2}
Epoch 3: 100%|##########| 1000/1000 [03:05<00:00,  5.40it/s, v_num=0, train_loss_step=0.412]
Metric val_loss improved by 0.012 >= min_delta = 0.0. New best score: 0.401
  File "/opt/conda/lib/python3.10/site-packages/torch/distributed/distributed_c10d.py", line 2501, in \
all_reduce
ssh: connect to host node2 port 22: Connection refused
[1] 48211
"""


def test_the_source_grounded_patterns_leave_a_healthy_job_alone():
    # NCCL init lines, a start-up overflow and a hysteresis step, progress and metric lines, an
    # exception frame in distributed_c10d, an unrelated connect failure, a shell job number.
    result = DIAGNOSER.diagnose_texts({"job.log": HEALTHY_JOB})
    assert result.category == "unknown", [(m.pattern_id, m.text) for m in result.matches]


def test_a_hardware_cause_outranks_a_nan_in_the_metrics():
    text = _steps([4.1, "nan"]) + "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n"
    assert DIAGNOSER.diagnose_texts({"a.log": text}).category == "gpu_hardware"


# ------------------------------------------------------------------ the real-log corpus
def test_corpus_split_follows_its_rule_and_cites_threads():
    from trainpilot.health.corpus import expected_splits, load_corpus

    corpus = load_corpus()
    assert len(corpus.cases) >= 70
    splits = expected_splits(corpus.cases)
    assert all(c.split == splits[c.id] for c in corpus.cases)
    held = sum(c.split == "held_out" for c in corpus.cases)
    assert held >= len(corpus.cases) / 2
    assert all(c.project in c.url for c in corpus.cases)
    assert all(sum(len(t) for t in c.logs.values()) < 2000 for c in corpus.cases)  # excerpts


def test_corpus_accuracy_and_its_negative_control():
    from trainpilot.health.corpus import HELD_OUT_GATE, validate

    report = validate()
    ok, total = report.accuracy("authoring")
    # Patterns were written against batches 1-4's; the ones left are logs with no error line (two
    # that simply stop) and three step-time lines of a slowing run. Batch 4's two (a py-spy dump,
    # an old `size mismatch, m1:`) got patterns on 2026-12-03; batch 3's nvidia-smi table of a
    # hung job (every GPU at 100 % on a quarter of its power) the spin rule on 2026-12-06.
    # Batch 9's nccl-1417 is a user's own print of mismatched tensor sizes (no library line).
    # Batch 12's two are hangs again: a bare py-spy stack with no thread header
    # (pytorch-lightning-18857) and a log that stops after the pipeline engine's set-up lines
    # (gpt-neox-988). Batch 27's 3d-student-splatting-and-scooping-5 is a bare `assert 1==0` in a
    # rasterizer's backward: the thread, not the log, says its gradients had turned NaN.
    # Batch 28's nanogpt-55 is ProcessGroupNCCL's generic "Some NCCL operations have failed or
    # timed out" only; the missing InfiniBand (NCCL_IB_DISABLE=1 fixed it) is in the thread.
    # (Batch 35's crnn-pytorch-7, a loss printed as `train_batch_loss[ 6590 ]:  nan`, is read
    # since 2026-12-07: the loss field may carry a bracketed index.) (DDP's unused-parameter
    # error, which batches 38-67 labelled collective_mismatch - simcse-78, ultralytics-3122,
    # llamafactory-3102, mmagic-419, joligen-104, pytorch-lightning-20685, strip-r-cnn-17,
    # mmdetection-8626, pose-with-style-22 and ultralyticspro-104 among the authoring cases - is
    # user_code under the definitions of 2026-12-08: failure_logs.yaml's header.) Batch 39's
    # simpletuner-59 is a data-loading failure its collector noted could be read as user_code
    # (its label kept as collected). Batch 40's flower-955 is a Flower server log that stops at
    # "FL starting" (it waits for a second client). Batch 66's paddle-11568 is a parameter-server
    # worker's "grpc error:Connect Failed" whose category the log does not settle. Batch 56's
    # streaming-145,
    # batch 59's deepfacelab-939, batch 64's elegy-234, batch 65's chexclusion-4 and batch 71's
    # torchseg-59 are hangs whose logs just stop; batch 69's pytorch-biggraph-159 is one whose
    # log repeats a waiting line ("still in queue: 24") every second. Batch 74's autokeras-191
    # is a bare "out of memory" line, AutoKeras's own print after a CUDA out-of-memory it
    # caught. Batch 81's pytorch-684 is rocm-smi failing to read a GPU's sensors after the amdgpu
    # driver crashed (the thread shows the crash; GPUs without those sensors print the same).
    # Batch 90's gensim-285 and fasttext-618 are runs whose logs just stop, and its glove-199 a
    # divergence seen only in GloVe's "cost:" field (no loss field; "cost" also names timings).
    # Batch 95's rasa-5587 is Rasa's "No NLU data given", labelled dataloader (the file's format
    # was not read), which a wrong --nlu path prints as well. (Batch 46's fb-bev-42, "Default process group has not been initialized" in a
    # single-process run, got its pattern the day it was scored, as did batch 49's gemma-431,
    # scenic-709 and dreamerv3-5, batch 50's spleeter-480, batch 52's transformers-22328, batch
    # 54's slowfast-438, batch 56's dali-486 and horovod-3082, batch 57's become-yukarin-65,
    # batch 59's dgd_person_reid-17, batch 63's optuna-1186, batch 66's horovod-1152 and
    # tensorflow-42834, batch 67's deepsleepnet-25 and context-encoder-11, batch 69's
    # tensorflow-34066, batch 70's opacus-319, batch 71's jointre-7, batch 75's
    # muzero-general-102, muzero-general-40 and leela-zero-1122, and batch 76's torch7-643 and
    # mxnet-6050.)
    misses = {o.case.id for o in report.outcomes if o.case.split == "authoring" and not o.correct}
    assert misses <= {"pytorch-15638", "vllm-8087", "mmf-29", "nccl-1417",
                      "pytorch-lightning-18857", "gpt-neox-988",
                      "3d-student-splatting-and-scooping-5", "nanogpt-55", "simpletuner-59",
                      "flower-955", "streaming-145", "deepfacelab-939", "elegy-234",
                      "chexclusion-4", "paddle-11568", "pytorch-biggraph-159", "torchseg-59",
                      "autokeras-191", "pytorch-684", "glove-199", "gensim-285",
                      "fasttext-618", "rasa-5587"}, misses
    held, n = report.accuracy("held_out")
    # A regression floor at the measured level (docs/health.md), not the 90 % target.
    assert held / n >= HELD_OUT_GATE, report.to_dict()["misses"]
    # Negative control: a diagnoser without its patterns gets the corpus wrong.
    from trainpilot.health.diagnosis import PatternLibrary

    empty = LIBRARY.model_copy(update=dict(patterns=[LIBRARY.patterns[0]]))
    blind = validate(Diagnoser(PatternLibrary.model_validate(empty.model_dump()),
                               metric_rules=False))
    assert blind.accuracy("held_out")[0] < n / 2


def test_cli_validate_prints_accuracy_per_category():
    result = run_cli("diagnose", "--validate", "--json")
    data = __import__("json").loads(result.stdout)
    held = data["splits"]["held_out"]
    assert held["total"] >= 35 and math.isclose(held["accuracy"], held["correct"] / held["total"])
    assert result.returncode == (0 if held["accuracy"] >= 0.9 else 1)
    assert "collective_timeout" in held["by_category"]
    assert run_cli("diagnose").returncode == 2


def _smi_query(rows, *, aligned: bool) -> str:
    """An ``nvidia-smi --query-gpu=index,utilization.gpu,utilization.memory,memory.used
    --format=csv`` snapshot, as printed or piped through ``column -t -s ,``."""
    header = ["index", "utilization.gpu [%]", "utilization.memory [%]", "memory.used [MiB]"]
    lines = [header] + [[str(i), f"{g} %", f"{m} %", "78000 MiB"] for i, (g, m) in enumerate(rows)]
    sep = "   " if aligned else ", "
    return "\n".join(sep.join(cells) for cells in lines) + "\n"


def _smi_table(rows, watts: int = 330) -> str:
    """The default ``nvidia-smi`` table's GPU rows: (utilization %, memory used MiB) each, every
    GPU drawing ``watts`` of its 400 W cap."""
    out = ["| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |",
           "| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |",
           "|===============================+======================+======================|"]
    for i, (util, used) in enumerate(rows):
        out += [f"|   {i}  NVIDIA A100-SXM...  On   | 00000000:{i:02d}:00.0 Off |                    0 |",
                f"| N/A   45C    P0   {watts}W / 400W |  {used}MiB / 81920MiB |    {util}%      Default |",
                "+-------------------------------+----------------------+----------------------+"]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("aligned", [True, False])
def test_a_gpu_spinning_while_its_peers_idle_is_a_hang(aligned):
    """A collective waiting on a peer spins: nvidia-smi shows that GPU at 100 % with no memory
    traffic while the others sit at 0 %."""
    hung = _smi_query([(0, 0), (0, 0), (100, 0), (0, 0)], aligned=aligned)
    result = DIAGNOSER.diagnose_texts({"smi.txt": hung})
    assert result.category == "hang" and result.evidence.startswith("smi.txt:4: "), result
    # Negative controls: every GPU busy (training), and a busy GPU moving memory (real work on
    # one GPU beside idle ones is not a spin).
    for rows in ([(100, 40)] * 4, [(100, 35), (0, 0), (0, 0), (0, 0)]):
        text = _smi_query(rows, aligned=aligned)
        assert DIAGNOSER.diagnose_texts({"smi.txt": text}).category == "unknown", rows


def test_the_default_nvidia_smi_table_shows_a_spin_only_across_the_jobs_gpus():
    hung = _smi_table([(0, 60000), (100, 61000), (0, 60000), (0, 60000)])
    assert DIAGNOSER.diagnose_texts({"smi.txt": hung}).category == "hang"
    # Negative controls: a one-GPU job beside empty GPUs, and a node where every GPU is busy.
    alone = _smi_table([(100, 30000), (0, 3), (0, 3), (0, 3)])
    busy = _smi_table([(100, 60000)] * 4)
    for text in (alone, busy):
        assert DIAGNOSER.diagnose_texts({"smi.txt": text}).category == "unknown"


def test_every_gpu_busy_at_idle_power_is_a_spin_and_at_full_power_is_work():
    """A spin-wait shows as 100 % utilization at near-idle power; compute at 100 % draws most of
    the cap."""
    spinning = _smi_table([(100, 60000)] * 4, watts=80)
    assert DIAGNOSER.diagnose_texts({"smi.txt": spinning}).category == "hang"
    working = _smi_table([(100, 60000)] * 4, watts=330)  # negative control
    assert DIAGNOSER.diagnose_texts({"smi.txt": working}).category == "unknown"


@pytest.mark.parametrize("line, category", [
    # Horovod's coordinator (controller.cc ConstructResponse), two of its forms.
    ("[1,2]<stderr>:tensorflow.python.framework.errors_impl.FailedPreconditionError: Mismatched "
     "ALLREDUCE CPU/GPU device selection: One rank specified device GPU, but another rank "
     "specified device CPU.", "collective_mismatch"),
    ("horovod.common.exceptions.HorovodInternalError: Mismatched ALLGATHER tensor shapes: One rank "
     "sent a tensor with dimension 1 equal to 10, but another rank sent a tensor with dimension 1 "
     "equal to 12.", "collective_mismatch"),
    # Negative control: "Mismatched" in a checkpoint load is not a collective.
    ("WARNING: Mismatched keys in state_dict: One rank file missing 'lm_head.weight'", "unknown"),
    # UCX's mlx5 completion errors (ib_mlx5_log.c), old and new line forms.
    ("ib_mlx5_log.c:132  Transport retry count exceeded on mlx5_0:1/IB (synd 0x15 vend 0x81 "
     "hw_synd 0/0)", "network"),
    ("[1733412345.123456] [node7:4127:0] ib_mlx5_log.c:179 UCX ERROR Error on QP 0x1a2b wqe[17]: "
     "Remote access (synd 0x13 vend 0x88) opcode RDMA_READ", "network"),
    # Negative control: a configuration print of the retry count is not a failure.
    ("UCX_RC_RETRY_COUNT=7  # transport retry count", "unknown"),
])
def test_horovod_mismatch_and_ucx_completion_errors(line, category):
    assert DIAGNOSER.diagnose_texts({"rank.log": line + "\n"}).category == category


def test_speechbrain_stops_on_a_non_finite_loss_and_early_stopping_is_not_one():
    stop = ("ValueError: Loss is not finite and patience is exhausted. To debug, wrap `fit()` with "
            "autograd's `detect_anomaly()`, e.g.\n")
    assert DIAGNOSER.diagnose_texts({"train.log": stop}).category == "numerical"
    # Negative control: an early-stopping callback's patience running out is a healthy end.
    healthy = "EarlyStopping: patience is exhausted after 5 epochs without improvement, stopping\n"
    assert DIAGNOSER.diagnose_texts({"train.log": healthy}).category == "unknown"


@pytest.mark.parametrize("line, category", [
    # TensorStore's file kvstore (kvstore.cc "Error %s %s"; internal/os/file_lock.cc).
    ('ValueError: Error opening "zarr" driver: Error writing local file "/gpfs/ckpt/checkpoint_100'
     '.tmp/state.step/.zarray": Failed to acquire lock on file: "/gpfs/ckpt/checkpoint_100.tmp/'
     'state.step/.zarray.__lock" [OS error: Invalid argument]', "storage"),
    # Negative control: a web app's own "error writing local file" message names no TensorStore key.
    ("2024-05-01 12:00:00 INFO cache: no error writing local file cache.json", "unknown"),
    # OmegaConf / Hydra config errors are the user's config.
    ("omegaconf.errors.ConfigAttributeError: Missing key train", "user_code"),
    ("omegaconf.errors.MissingMandatoryValue: Missing mandatory value: model.dim", "user_code"),
    # Negative control: a config printed by the run that mentions omegaconf is not an error.
    ("[INFO] config loaded with omegaconf 2.3.0 (errors: 0)", "unknown"),
])
def test_tensorstore_file_errors_and_config_errors(line, category):
    assert DIAGNOSER.diagnose_texts({"rank.log": line + "\n"}).category == category


@pytest.mark.parametrize("line, category", [
    # Intel Gaudi's device-memory allocator (Accelerate's should_reduce_batch_size: "HPU OOM").
    ("RuntimeError: [Rank:0] FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for "
     "size::268435456 (256)MB", "device_oom"),
    # Negative control: another module's fatal error on Gaudi is not a memory failure (only an
    # uncaught exception, which the no-match fallback calls user_code).
    ("RuntimeError: [Rank:0] FATAL ERROR :: MODULE:PT_BRIDGE Exception in Lowering thread...",
     "user_code"),
    # ClearML's storage helper refusing a checkpoint upload (clearml/storage/helper.py).
    ("2024-06-24 11:46:37,590 - clearml.storage - ERROR - Exception encountered while uploading "
     "Failed uploading object /p/r.1/artifacts/latest.ckpt/last.ckpt (413): <!doctype html>",
     "storage"),
    # Negative control: another tool's upload message with the same words names no ClearML logger
    # or status code.
    ("Exception encountered while uploading usernotes: rate limited, retrying", "unknown"),
])
def test_gaudi_device_memory_and_clearml_upload_errors(line, category):
    assert DIAGNOSER.diagnose_texts({"rank.log": line + "\n"}).category == category


@pytest.mark.parametrize("line, category", [
    # FlashAttention refusing the GPU (flash_api.cpp; FlashAttention 1.x's fmha_api.cpp).
    ("RuntimeError: FlashAttention only supports Ampere GPUs or newer.", "user_code"),
    ("FlashAttention backward for head dim > 64 requires A100 or H100\nGPUs as the implementation "
     "needs a large amount of shared memory.", "user_code"),
    # Negative control: a start-up line naming the kernel is not a failure.
    ("INFO: Using FlashAttention-2 backend (Ampere GPUs or newer detected)", "unknown"),
])
def test_flash_attention_on_an_unsupported_gpu_is_a_setup_error(line, category):
    assert DIAGNOSER.diagnose_texts({"rank.log": line + "\n"}).category == category


_OLD_WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/env/lib/python3.6/site-packages/torch/utils/data/dataloader.py", line 106, in _worker_loop
    samples = collate_fn([dataset[i] for i in batch_indices])
  File "/work/dataset.py", line 34, in __getitem__
    label = self.db[self.labels_key][idx]
KeyError: 'Unable to open object (bad object header version number)'
"""


@pytest.mark.parametrize("text, category", [
    # A dataset's exception re-raised from a DataLoader worker: PyTorch >= 1.0's wrapper line,
    # and PyTorch <= 0.4's, whose message is the worker's traceback through _worker_loop.
    ("KeyError: Caught KeyError in DataLoader worker process 3.\n", "dataloader"),
    (_OLD_WORKER_TRACEBACK, "dataloader"),
    # Negative control: the same exception raised in the main process (num_workers=0) is the
    # training code's, not the loader's.
    (_OLD_WORKER_TRACEBACK.replace(
        '  File "/env/lib/python3.6/site-packages/torch/utils/data/dataloader.py", line 106, '
        "in _worker_loop\n", ""), "user_code"),
])
def test_an_exception_raised_in_a_dataloader_worker_is_a_data_loading_failure(text, category):
    assert DIAGNOSER.diagnose_texts({"rank0.log": text}).category == category


@pytest.mark.parametrize("text, category", [
    # torch.distributions' parameter check on NaN logits (distribution.py _validate_args).
    ("ValueError: Expected parameter logits (Tensor of shape (280, 13)) of distribution "
     "Categorical(logits: torch.Size([280, 13])) to satisfy the constraint "
     "IndependentConstraint(Real(), 1), but found invalid values:\ntensor([[nan, nan]])\n",
     "numerical"),
    # Negative control: another ValueError about a parameter is the code's, not numerics.
    ("ValueError: Expected parameter lr to be a float, got str\n", "user_code"),
    # TensorFlow's collective executor (collective_ops.cc) on members with different shapes.
    ("W tensorflow/core/framework/op_kernel.cc:1655] OP_REQUIRES failed at collective_ops.cc:253 "
     ": Invalid argument: Shape mismatch in the collective instance 106. Op at device "
     "/job:worker/replica:0/task:1/device:CPU:0 expected shape [49] but another member in the "
     "group expected shape [64].\n", "collective_mismatch"),
    # Negative control: a shape error inside one worker's graph is not a collective's.
    ("tensorflow.python.framework.errors_impl.InvalidArgumentError: Incompatible shapes: "
     "[49] vs. [64]\n", "user_code"),
])
def test_distribution_constraint_nan_and_tensorflow_collective_shape_mismatch(text, category):
    assert DIAGNOSER.diagnose_texts({"worker0.log": text}).category == category


@pytest.mark.parametrize("line, category", [
    # Caffe2's CUDA_ENFORCE on cudaErrorMemoryAllocation (code 2, "out of memory").
    ("RuntimeError: [enforce fail at event_gpu.cc:17] error == cudaSuccess. 2 vs 0. Error at: "
     "/home/sd/pytorch/caffe2/core/event_gpu.cc:17: out of memory", "device_oom"),
    # Negative control: the same check failing on another CUDA error is not an OOM.
    ("RuntimeError: [enforce fail at context_gpu.cu:415] error == cudaSuccess. 77 vs 0. Error "
     "at: /opt/caffe2/core/context_gpu.cu:415: an illegal memory access was encountered",
     "not device_oom"),
])
def test_caffe2_cuda_enforce_out_of_memory(line, category):
    got = DIAGNOSER.diagnose_texts({"train.log": line + "\n"}).category
    assert got == category if category != "not device_oom" else got != "device_oom"


@pytest.mark.parametrize("text, category", [
    # Ray's memory monitor (python/ray/exceptions.py OutOfMemoryError).
    ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n",
     "host_oom"),
    # Negative control: another Ray task error is not a host OOM.
    ("ray.exceptions.RayTaskError(ValueError): ray::SimEnv.step() (pid=4331)\n", "not host_oom"),
    # Horovod's Gloo rendezvous store (horovod/common/gloo/http_store.cc).
    ("[1]<stderr>:  what():  [horovod/common/gloo/http_store.cc:53] "
     "[horovod/common/gloo/http_store.cc:53] Wait timeout for key(s): 0\n", "rendezvous"),
    # horovodrun's and Open MPI's rank prefixes before an exception line.
    ("[6]<stderr>:    TypeError: `x` and `y` must have the same dtype, got tf.float32 != "
     "tf.int32.\n", "user_code"),
    ("[1,6]<stderr>:RuntimeError: boom\n", "user_code"),
    # Negative control: a prefixed healthy line.
    ("[6]<stdout>: step 10 loss 2.31\n", "unknown"),
])
def test_ray_oom_horovod_gloo_rendezvous_and_rank_prefixed_exceptions(text, category):
    got = DIAGNOSER.diagnose_texts({"job.log": text}).category
    assert got != "host_oom" if category == "not host_oom" else got == category


def test_a_horovodrun_prefix_names_the_rank():
    result = DIAGNOSER.diagnose_texts({"job.log": "[1,6]<stderr>:RuntimeError: boom\n"})
    assert result.rank == 6


@pytest.mark.parametrize("line, category", [
    # The dynamic loader's dlerror text: a library missing from the environment.
    ("06/02 00:10:53 - mmengine - WARNING - WARNING: command error: 'libGL.so.1: cannot open "
     "shared object file: No such file or directory'!", "user_code"),
    ("ImportError: libcudnn.so.8: cannot open shared object file: No such file or directory",
     "user_code"),
    # Negative control: NCCL probing for its optional network plugin in a healthy run.
    ("node1:2241:2290 [0] NCCL INFO NET/Plugin : Plugin load (libnccl-net.so) returned 2 : "
     "libnccl-net.so: cannot open shared object file: No such file or directory", "unknown"),
])
def test_a_missing_shared_library_is_a_setup_error(line, category):
    assert DIAGNOSER.diagnose_texts({"train.log": line + "\n"}).category == category


_LIGHTNING_START = """Multi-processing is handled by Slurm.
GPU available: True, used: True
initializing ddp: GLOBAL_RANK: 0, MEMBER: 1/8
"""


@pytest.mark.parametrize("text, category", [
    # The log stops at Lightning's rendezvous line: the other ranks never joined.
    (_LIGHTNING_START, "rendezvous"),
    (_LIGHTNING_START.replace("initializing ddp", "Initializing distributed") + "\n\n",
     "rendezvous"),
    # Negative control: the same line followed by training is a healthy start.
    (_LIGHTNING_START + "  | Name  | Type | Params\nEpoch 0:  10%| 100/1000 [00:10<01:30, "
     "loss=2.31]\n", "unknown"),
])
def test_a_log_that_stops_at_lightnings_rendezvous_line(text, category):
    result = DIAGNOSER.diagnose_texts({"rank0.log": text})
    assert result.category == category
    if category == "rendezvous":
        assert result.rank == 0 and "GLOBAL_RANK: 0" in result.evidence


@pytest.mark.parametrize("text, category", [
    # An illegal memory access on its own is a software bug (nerfstudio-1534: tiny-cuda-nn).
    ("terminate called after throwing an instance of 'std::runtime_error'\n"
     "  what():  multi_stream.h:83 cudaEventRecord(m_event, m_stream) failed with error an "
     "illegal memory access was encountered\n", "user_code"),
    # Negative control: with the driver's Xid beside it, the GPU is named.
    ("NVRM: Xid (PCI:0000:3b:00): 31, pid=4411, Ch 00000010, intr 00000000. MMU Fault\n"
     "RuntimeError: CUDA error: an illegal memory access was encountered\n", "gpu_hardware"),
])
def test_an_illegal_memory_access_is_software_unless_the_gpu_reports_a_fault(text, category):
    assert DIAGNOSER.diagnose_texts({"train.log": text}).category == category
