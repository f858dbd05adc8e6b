"""Training checkpoints: one file, written atomically (temporary file, fsync, rename).

It holds the model and optimizer/scheduler states, every RNG state, the data position and the config, so
`--resume` continues exactly where the run stopped (tests check 6 steps == 3 + resume + 3).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

FILENAME = "checkpoint.pt"
FORMAT = 1


def save_checkpoint(run_dir: str | Path, payload: dict[str, Any]) -> Path:
    """Write run_dir/checkpoint.pt atomically; a crash mid-write leaves the previous checkpoint intact."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / FILENAME
    tmp = run_dir / (FILENAME + ".tmp")
    data = dict(payload, format=FORMAT, rng=rng_state())
    with open(tmp, "wb") as f:
        torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    """Read run_dir/checkpoint.pt and restore the RNG states; clear errors for missing or damaged files."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from: {path} does not exist (run without --resume)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises several types for truncated/corrupt files
        raise ValueError(
            f"checkpoint {path} is damaged or truncated ({type(err).__name__}: {err}); "
            "delete it to start over, or restore a good copy"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} is not a LongStraw checkpoint of format {FORMAT}")
    set_rng_state(data["rng"])
    return data


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
