"""`longstraw train --nproc N`: what every rank would refuse is found once, in the launcher, before any rank starts and
before the run directory exists (the model's config read, no weights); a rank that refuses anyway leaves its process
group before the interpreter ends (no SIGABRT from gloo's threads at exit)."""

import json
import time
from pathlib import Path

import pytest

from longstraw.cli import main
from longstraw.distributed import launch


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if the launcher starts ranks."""
    def started(argv, nproc):
        raise AssertionError(f"ranks were started: {argv}")

    monkeypatch.setattr(launch, "launch_train", started)


def _zamba_dir(tmp_path: Path) -> Path:
    """A local model directory of a refused family (zamba): its config alone, no weights."""
    from transformers import ZambaConfig

    path = tmp_path / "zamba"
    ZambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=8, num_attention_heads=2, attention_head_dim=16,
                intermediate_size=64, mamba_d_state=4, n_mamba_heads=1).save_pretrained(path)
    assert not any(p.suffix == ".safetensors" for p in path.iterdir())
    return path


@pytest.mark.parametrize("options,message", [
    (["--model", "tiny-qwen3", "--tp", "2"], "qwen3 has 4 query and 1 key/value heads, which 2 must divide"),
    (["--model", "tiny-mamba2", "--tp", "2"], "tensor parallelism on mamba2: transformers ships no tensor-parallel"),
    (["--model", "ZAMBA"], "architecture 'zamba' is refused"),
    (["--task", "lookup", "--prompt-tokens", "5"], "prompt_tokens=5 is too small"),
    (["--task", "passkey", "--prompt-tokens", "3"], "prompt_tokens=3 is too small"),
], ids=["tp-heads", "tp-family", "refused-family", "lookup-prompt", "passkey-prompt"])
def test_what_every_rank_refuses_is_said_once_before_any_rank_starts(options, message, tmp_path, capsys, no_ranks):
    options = [str(_zamba_dir(tmp_path)) if o == "ZAMBA" else o for o in options]
    run_dir = tmp_path / "run"
    start = time.monotonic()
    assert main(["train", *options, "--steps", "1", "--prompts-per-step", "2", "--run-dir", str(run_dir),
                 "--nproc", "2"]) == 1
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("longstraw train: error: ") and message in lines[0], err
    assert not run_dir.exists()  # nothing created


def test_one_process_options_under_nproc_are_refused_by_the_launcher(tmp_path, capsys, no_ranks):
    for options, message in ((["--task", "lookup", "--warm-start-steps", "1"], "--warm-start-steps runs in one "
                              "process only"),
                             (["--plan", "detach", "--bias-every", "1"], "--bias-every runs in one process only")):
        with pytest.raises(SystemExit) as exc:
            main(["train", *options, "--prompts-per-step", "2", "--run-dir", str(tmp_path / "run"), "--nproc", "2"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("longstraw train: error: ") and message in err and err.count("error") == 1, err
        assert not (tmp_path / "run").exists()


def test_the_launcher_starts_the_ranks_when_nothing_is_refused(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(launch, "launch_train", lambda argv, nproc: started.append((argv, nproc)) or 0)
    assert main(["train", "--model", "tiny-llama", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                 "--nproc", "2", "--prompts-per-step", "2"]) == 0
    assert started and started[0][1] == 2 and "--nproc" not in started[0][0]


def test_a_rank_that_refuses_leaves_its_process_group_before_exit(spawn, tmp_path):
    """Both ranks refuse right after joining the group (--bias-every under several processes): each prints its one
    line and exits 1 with the group destroyed (a gloo group alive at interpreter exit can abort the process)."""
    args = [str(Path(__file__).with_name("refusing_rank.py")), "--plan", "detach", "--bias-every", "1",
            "--prompts-per-step", "2", "--run-dir", str(tmp_path / "run")]
    start = time.monotonic()
    results = spawn(args, world=2, timeout=120, cwd=tmp_path)
    assert time.monotonic() - start < 60  # neither rank waits out the other's acknowledgement
    for rank, (code, out) in enumerate(results):
        assert code == 1, f"rank {rank}:\n{out}"
        assert "longstraw train: error: --bias-every runs in one process only" in out, out
        assert "process group alive at exit: False" in out, f"rank {rank}:\n{out}"
        assert "Traceback" not in out and "terminate called" not in out, out
    assert json.dumps(results)  # plain text only
