"""trainpilot checkpoints read by stock torch.distributed.checkpoint (its FileSystemReader,
``dcp.load`` into a plain module, ``dcp_to_torch_save``), while our own restore keeps reading
only the JSON manifest."""

from __future__ import annotations

import io
import math
import pickle
import zipfile
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer, committed
from trainpilot.runtime.checkpoint.interop import ALIGN, data_pkl, envelope
from trainpilot.runtime.checkpoint.layout import read_manifest
from trainpilot.runtime.checkpoint.storage import tensor_bytes


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4, bias=False)).to(torch.float32)


def _save(root, step: int, module, **kw) -> str:
    opt = torch.optim.AdamW(module.parameters())
    module(torch.randn(3, 8)).sum().backward()
    opt.step()
    with Checkpointer(CheckpointConfig(root_dir=root, async_save=False, **kw)) as ckpt:
        ckpt.save(step, {"model": module.state_dict(), "optim": opt.state_dict(),
                         "step": step}).result()
    return str(root / committed(root)[0][1])


def test_stock_dcp_load_fills_a_plain_module(tmp_path):
    saved = _module(0)
    folder = _save(tmp_path / "ckpt", 5, saved)
    fresh = _module(1)
    assert not torch.equal(fresh[0].weight, saved[0].weight)  # the oracle can fail
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=folder)  # DCP's own FileSystemReader: .metadata + torch.load
    fresh.load_state_dict(state["model"])
    for name, tensor in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_dcp_to_torch_save_converts_a_checkpoint(tmp_path):
    saved = _module(0)
    folder = _save(tmp_path / "ckpt", 5, saved)
    dcp_to_torch_save(folder, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(full["model"]) == set(saved.state_dict())
    for name, tensor in saved.state_dict().items():
        assert torch.equal(full["model"][name], tensor)
    assert "optim" in full  # optimizer tensors too (non-tensor state is JSON, ours only)


def test_incremental_checkpoints_reference_older_folders_for_dcp_too(tmp_path):
    root = tmp_path / "ckpt"
    module = _module(0)
    with Checkpointer(CheckpointConfig(root_dir=root, async_save=False,
                                       incremental=True)) as ckpt:
        ckpt.save(1, {"model": module.state_dict()}).result()
        with torch.no_grad():
            module[0].weight.add_(1.0)  # only this tensor changes
        report = ckpt.save(2, {"model": module.state_dict()}).result()
    assert report.incremental and report.bytes_referenced > 0
    fresh = _module(7)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(root / committed(root)[0][1]))
    for name, tensor in module.state_dict().items():
        assert torch.equal(state["model"][name], tensor), name


def test_our_restore_ignores_dcp_metadata(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    saved = _module(0)
    folder = _save(root, 5, saved)
    (root / committed(root)[0][1] / ".metadata").write_bytes(b"not a pickle")
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load"))
    restored = Checkpointer(CheckpointConfig(root_dir=root)).restore_latest(
        {"model": _module(1).state_dict()}, source="storage")
    assert restored is not None and folder.endswith(restored.path.split("/")[-1])
    for name, tensor in saved.state_dict().items():
        assert torch.equal(restored.state["model"][name], tensor)


def test_zstd_checkpoints_say_they_are_not_dcp_readable(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 3, _module(0), compress=True)
    name = committed(root)[0][1]
    assert not (root / name / ".metadata").exists()
    assert read_manifest(root, name)["dcp_readable"] is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.uint8, torch.bool])
@pytest.mark.parametrize("shape", [(2, 3), (7,), (), (0, 4)])
def test_envelope_is_a_torch_save_archive(dtype, shape):
    tensor = torch.arange(math.prod(shape)).to(dtype).reshape(shape)
    raw = bytes(tensor_bytes(tensor))
    ref = io.BytesIO()
    torch.save(tensor, ref)
    assert zipfile.ZipFile(ref).read("archive/data.pkl") == data_pkl(dtype, shape)
    for zip64 in (False, True):
        before, after = envelope(dtype, shape, len(raw), zlib.crc32(raw), force_zip64=zip64)
        archive = before + raw + after
        assert len(before) % ALIGN == 0  # the tensor bytes 64-byte aligned, as torch.save does
        assert zipfile.ZipFile(io.BytesIO(archive)).testzip() is None  # CRCs and sizes right
        loaded = torch.load(io.BytesIO(archive), weights_only=True)
        assert loaded.dtype == dtype and torch.equal(loaded, tensor)
