"""Checkpoint files: read without running code, checksummed, complete; weights-only checkpoints."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import train_child
from helpers import jsonl_dataset

from longstraw.train.checkpoints import digest, load_checkpoint, save_checkpoint


def _data(tmp: Path) -> Path:
    return jsonl_dataset(tmp)


def _common(data: Path) -> list[str]:
    return ["train", "--model", "tiny-llama", "--task", "jsonl", "--data", str(data),
            "--reward-fn", "rewards_for_tests:even_byte_fraction", "--group-size", "3", "--max-new-tokens", "4",
            "--lr", "1e-3", "--eval-prompts", "0", "--no-plot", "--chunk-size", "8", "--steps", "4"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A real run stopped after 2 of 4 steps (checkpoint with AdamW state), and its command line."""
    tmp = tmp_path_factory.mktemp("ckpt")
    common = _common(_data(tmp))
    run = tmp / "run"
    code = train_child.run([*common, "--stop-after", "2", "--run-dir", str(run)], tmp / "log")
    assert code == 0, (tmp / "log").read_text()
    return run, common


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _resume(common: list[str], run: Path, *extra: str) -> tuple[int, str]:
    log = run.parent / f"log-{run.name}"
    code = train_child.run([*common, "--run-dir", str(run), "--resume", *extra], log)
    return code, log.read_text()


def test_a_real_checkpoint_holds_only_tensors_and_plain_values(stopped_run):
    run, _ = stopped_run
    data = torch.load(run / "checkpoint.pt", weights_only=True)  # raises on anything else
    assert data["step"] == 2 and data["format"] == 2 and data["config"]["model"] == "tiny-llama"
    assert data["optimizer"]["state"] and isinstance(data["rng"]["torch"], torch.Tensor)
    verified = load_checkpoint(run)  # and the checksum matches
    assert set(verified) >= {"step", "model", "optimizer", "scheduler", "config", "rng", "summary"}


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    """A pickle that calls exec() when unpickled: refused, and the code never runs."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    run = tmp_path / "run"
    run.mkdir()
    torch.save({"format": 2, "step": 1, "model": Payload()}, run / "checkpoint.pt")
    with pytest.raises(ValueError, match="holds objects other than tensors and plain values") as err:
        load_checkpoint(run)
    assert str(run / "checkpoint.pt") in str(err.value)
    assert not marker.exists()


def _flip_tensor_bytes(path: Path) -> None:
    """Flip 16 bytes in the middle of the largest tensor record of the checkpoint's zip archive."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
        start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(start)
        chunk = f.read(16)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in chunk))


def test_flipped_bytes_in_tensor_data_are_refused_on_resume(stopped_run, tmp_path):
    run, common = stopped_run
    run = _copy(run, tmp_path)
    _flip_tensor_bytes(run / "checkpoint.pt")
    torch.load(run / "checkpoint.pt", weights_only=True)  # torch itself does not notice: the checksum must
    code, log = _resume(common, run)
    assert code == 1, log
    assert f"checkpoint {run / 'checkpoint.pt'} is corrupted" in log and "Traceback" not in log
    assert "step 3/4" not in log  # refused before any training


@pytest.mark.parametrize("key", ["scheduler", "optimizer", "rng"])
def test_a_checkpoint_missing_an_entry_says_which(stopped_run, tmp_path, key):
    run, _ = stopped_run
    run = _copy(run, tmp_path)
    data = torch.load(run / "checkpoint.pt", weights_only=True)
    del data[key]
    torch.save(data, run / "checkpoint.pt")
    with pytest.raises(ValueError, match=f"lacks '{key}'"):
        load_checkpoint(run)


def test_checksum_covers_every_value(tmp_path):
    payload = {"step": 3, "model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": None, "scheduler": {},
               "config": {"lr": 1e-3}, "summary": {}, "rng": {"python": [3, [1, 2], None]}}
    base = digest(payload)
    assert digest({**payload, "step": 4}) != base
    assert digest({**payload, "config": {"lr": 2e-3}}) != base
    assert digest({**payload, "model": {"w": torch.arange(6.0).reshape(3, 2)}}) != base  # shape counts
    assert digest({**payload, "model": {"w": torch.arange(6.0).reshape(2, 3).double()}}) != base  # dtype counts
    save_checkpoint(tmp_path, payload)
    assert load_checkpoint(tmp_path)["step"] == 3


def test_save_weights_only_is_smaller_and_resume_says_the_optimizer_restarts(stopped_run, tmp_path):
    _, common = stopped_run
    run = tmp_path / "lean"
    code = train_child.run([*common, "--stop-after", "2", "--save-weights-only", "--run-dir", str(run)],
                           tmp_path / "log")
    assert code == 0, (tmp_path / "log").read_text()
    data = load_checkpoint(run)
    assert data["optimizer"] is None and data["model"]
    full = (stopped_run[0] / "checkpoint.pt").stat().st_size
    assert (run / "checkpoint.pt").stat().st_size < 0.5 * full  # AdamW keeps two tensors per parameter
    code, log = _resume(common, run)
    assert code == 0, log
    assert "holds weights only (save_weights_only): the optimizer state restarts from zero at step 2" in log
    assert load_checkpoint(run)["step"] == 4
