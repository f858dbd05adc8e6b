"""The verdict cache (`verify.verdict_for`): a file that is not a verdict of its config is named in a warning and
measured again; an empty LONGSTRAW_CACHE is the default folder; the key holds a hash of the deciding code; a cached
refusal names its file; `longstraw check` says whether it read the cache."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import transformers

from longstraw import cli
from longstraw.admission import verify


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    monkeypatch.setattr(verify, "_VERDICTS", {})
    return tmp_path / "verdicts"


def _gpt2():
    return transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=100)


def _measured(monkeypatch) -> list[int]:
    """Count the measurements verdict_for makes from now on (each returns a fixed admitted verdict)."""
    calls: list[int] = []

    def fake(config, seed=0):
        calls.append(1)
        return verify.Verdict(model_type="gpt2", config_hash=verify.config_hash(config), kind="exact", tolerance=1e-9)

    monkeypatch.setattr(verify, "verify", fake)
    return calls


@pytest.mark.parametrize("content", ["[]", '{"kind": "exact"}', '{"model_type": "gpt2", "config_hash": "0", '
                                     '"kind": "exact", "tolerance": 1e-9}', "", "{cut"])
def test_a_file_that_is_not_a_verdict_is_named_and_measured_again(cache, monkeypatch, content):
    config = _gpt2()
    path = cache / f"{verify.verdict_key(config)}.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    calls = _measured(monkeypatch)
    with pytest.warns(UserWarning, match=f"verdict cache {path}: not a readable verdict .*measuring again"):
        verdict = verify.verdict_for(config)
    assert calls == [1] and verdict.admitted and not verdict.from_cache
    assert json.loads(path.read_text())["kind"] == "exact"  # rewritten with the new measurement


def test_an_unreadable_cache_file_is_named_and_measured_again(cache, monkeypatch):
    config = _gpt2()
    path = cache / f"{verify.verdict_key(config)}.json"
    path.mkdir(parents=True)  # a folder where the file should be: cannot be read (nor replaced)
    calls = _measured(monkeypatch)
    with pytest.warns(UserWarning, match=f"verdict cache {path}: not a readable verdict"):
        verdict = verify.verdict_for(config)
    assert calls == [1] and verdict.admitted and verdict.cache_file is None


def test_an_empty_longstraw_cache_is_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LONGSTRAW_CACHE", "")
    assert verify.cache_dir() == tmp_path / ".cache" / "longstraw" / "verdicts"
    from longstraw.models.gguf_files import cache_root

    assert cache_root() == tmp_path / ".cache" / "longstraw"


def test_the_key_holds_a_hash_of_the_deciding_code(tmp_path):
    """A change to any source file of the deciding code (an upgrade) changes the key, so the config is checked again;
    the package version alone never changes in a source checkout."""
    assert f"-code{verify.code_hash()}" in verify.verdict_key(_gpt2())
    (tmp_path / "admission").mkdir()
    source = tmp_path / "admission" / "verify.py"
    source.write_text("TOL = 1e-9\n")
    before = verify.source_hash(tmp_path, ("admission",))
    source.write_text("TOL = 1e-6\n")
    assert verify.source_hash(tmp_path, ("admission",)) != before


def test_a_cached_refusal_names_its_file(cache, monkeypatch):
    config = _gpt2()
    monkeypatch.setattr(verify, "verify", lambda config, seed=0: verify.Verdict(
        model_type="gpt2", config_hash=verify.config_hash(config), kind="refused", tolerance=1e-9,
        logprob_error=0.5))
    path = cache / f"{verify.verdict_key(config)}.json"
    assert f"cached in {path}: delete it to measure again" in verify.verdict_for(config).refusal()
    monkeypatch.setattr(verify, "_VERDICTS", {})
    monkeypatch.setattr(verify, "verify", lambda config, seed=0: pytest.fail("measured again"))
    again = verify.verdict_for(config)
    assert again.from_cache and f"verdict read from {path}: delete it to measure again" in again.refusal()


def test_check_says_whether_it_read_the_cache(cache, capsys, monkeypatch):
    assert cli.main(["check", "tiny-llama"]) == 0
    out = capsys.readouterr().out
    assert f"verdict measured now; cached in {cache}" in out
    monkeypatch.setattr(verify, "_VERDICTS", {})  # a new process
    assert cli.main(["check", "tiny-llama"]) == 0
    assert f"verdict read from the cache: {cache}" in capsys.readouterr().out
    monkeypatch.setattr(verify, "_VERDICTS", {})
    assert cli.main(["check", "tiny-llama", "--no-cache"]) == 0
    assert "verdict measured now" in capsys.readouterr().out


def test_the_saved_verdict_holds_no_cache_fields(cache):
    verdict = verify.verdict_for(_gpt2())
    saved = json.loads(Path(verdict.cache_file).read_text())
    assert "cache_file" not in saved and "from_cache" not in saved
    assert dataclasses.replace(verdict, cache_file=None) == verify.Verdict(**{**saved, "float32_ops": tuple(
        saved["float32_ops"])})
