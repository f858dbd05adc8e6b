"""`TrainConfig`: every training option, in seven sections (`train.sections`), validated on construction.

Loadable from a TOML file whose `[model]`, `[task]`, `[rollout]`, `[plan]`, `[optimizer]`, `[run]` and
`[parallelism]` tables are the sections, and overridable on the command line: each field of each section becomes
`--field-name` (booleans: `--flag` / `--no-flag`). Each section checks its own fields; `TrainConfig.__post_init__`
checks the combinations across sections, with a message that says what to change."""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from longstraw.choices import did_you_mean
from longstraw.plan import DETACH, Plan
from longstraw.train import sections
from longstraw.train.sections import field_kind, need, of_kind


@dataclass
class TrainConfig:
    """The seven sections; `cfg.<section>.<option>` (cfg.rollout.group_size, cfg.plan.plan: a `Plan`)."""

    model: sections.ModelSection = field(default_factory=sections.ModelSection)
    task: sections.TaskSection = field(default_factory=sections.TaskSection)
    rollout: sections.RolloutSection = field(default_factory=sections.RolloutSection)
    plan: sections.PlanSection = field(default_factory=sections.PlanSection)
    optimizer: sections.OptimizerSection = field(default_factory=sections.OptimizerSection)
    run: sections.RunSection = field(default_factory=sections.RunSection)
    parallelism: sections.ParallelismSection = field(default_factory=sections.ParallelismSection)

    def __post_init__(self) -> None:
        """The rules across sections (each section checked its own fields when it was built)."""
        task, rollout, plan, run, cp = self.task.task, self.rollout, self.plan.plan, self.run, self.parallelism.cp
        mean_centered = self.plan.advantage == "mean_centered"
        need(rollout.group_size >= 2 or mean_centered,
             f"group_size {rollout.group_size} is too small: GRPO compares responses within a group; use >= 2")
        need(cp == 1 or plan.supports_context_parallel,
             f"cp = {cp} shards the prompt state, which the {plan} plan does not use: --plan detach or exact")
        # The meter measures the detach plan's bias; exact and standard compute the unbiased gradient themselves.
        need(run.bias_every == 0 or plan is DETACH,
             f"bias_every measures the detach plan's gradient against the exact one; the {plan} plan computes "
             "the exact gradient itself (no bias to measure): use --plan detach or drop --bias-every")
        need(self.optimizer.warm_start_steps == 0 or task == "lookup",
             f"warm_start_steps trains on gold trajectories an agent task writes; task {task!r} writes none: use "
             "--task lookup or drop --warm-start-steps")
        if rollout.rollout != "tree":
            return
        need(rollout.tree_leaves >= 2 or mean_centered or rollout.tree_advantage == "siblings",
             f"tree_leaves {rollout.tree_leaves}: GRPO compares the leaves of a tree; use >= 2")
        need(rollout.tree_trigger == "tokens" or task == "lookup" or rollout.tree_depth == 1,
             f"--tree-trigger tool_call forks at tool calls, which task {task!r} has none of: use --task lookup, or "
             "--tree-trigger tokens --tree-every N")
        need(not plan.batched, f"--rollout tree trains with backward_tree, whose plans are exact, detach and "
                               f"standard; got {plan.name!r}")
        need(cp == 1, "--rollout tree does not run under context parallelism (backward_tree refuses it): drop --cp")
        need(run.bias_every == 0, "--bias-every measures groups (backward_group); --rollout tree has none: drop it")

    @classmethod
    def from_flat(cls, values: Mapping[str, Any] | None = None, /, **more: Any) -> TrainConfig:
        """A config from flat options, field name -> value as flags, TOML keys and `to_flat` name them (`values`,
        then `more`); the options not given keep their defaults. ValueError for a name no section has."""
        flat = {**(values or {}), **more}
        need(not set(flat) - set(SECTION_OF), unknown_options(flat))
        return cls(**{name: kind(**{key: flat[key] for key in SECTIONS[name] if key in flat})
                      for name, kind in SECTION_TYPES.items()})

    def to_flat(self) -> dict[str, Any]:
        """Every option by field name (a plan by name): what checkpoints and comparisons store, `from_flat` reads."""
        return {f.name: str(value) if isinstance(value := getattr(section, f.name), Plan) else value
                for section in (getattr(self, name) for name in SECTIONS) for f in fields(section)}


# The TOML file's sections (TrainConfig's fields) and the options each holds (its section's fields).
SECTION_TYPES: dict[str, type] = get_type_hints(TrainConfig)  # name -> section class, in field order
SECTIONS: dict[str, tuple[str, ...]] = {name: tuple(f.name for f in fields(kind))
                                        for name, kind in SECTION_TYPES.items()}
SECTION_OF = {name: section for section, names in SECTIONS.items() for name in names}
OPTION_FIELDS = [f for kind in SECTION_TYPES.values() for f in fields(kind)]  # every option, in section order


def unknown_options(names: Mapping[str, Any]) -> str:
    """The message naming the options among `names` that no section has, with the closest valid names."""
    unknown = sorted(set(names) - set(SECTION_OF))
    hints = "".join(did_you_mean(key, SECTION_OF) for key in unknown)
    return f"unknown option(s) {', '.join(unknown)}{hints}; valid options: {', '.join(sorted(SECTION_OF))}"


def _flatten_sections(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The `[section]` tables of a TOML file as one flat dict; ValueError for a key outside its section."""
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS or not isinstance(table, dict):  # a flat key (plan = "exact") or a mistyped name
            if section in SECTION_OF:
                raise ValueError(f"{path}: {section} belongs in [{SECTION_OF[section]}]")
            if not isinstance(table, dict):
                raise ValueError(f"{path}: unknown option {section}{did_you_mean(section, SECTION_OF)}")
            raise ValueError(f"{path}: unknown section [{section}]{did_you_mean(section, SECTIONS)}; sections: "
                             f"{', '.join(f'[{name}]' for name in SECTIONS)}")
        for key, value in table.items():
            if key in SECTION_OF and SECTION_OF[key] != section:
                raise ValueError(f"{path}: {key} belongs in [{SECTION_OF[key]}], not [{section}]")
            flat[key] = value
    return flat


def load_toml(path: str | Path) -> dict[str, Any]:
    """The options of a TOML file's `[section]` tables (SECTIONS), flat and checked against the fields."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x}): TOML files are UTF-8; save it as "
                         "UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # its message ends with "(at line N, column M)"
        raise ValueError(f"{path}: not valid TOML: {err}") from None
    data = _flatten_sections(path, data)
    need(not set(data) - set(SECTION_OF), f"{path}: {unknown_options(data)}")
    # A destructive option is honoured only when typed for this invocation: a file reused for a later run would
    # otherwise delete that run's directory without anyone asking for it.
    if data.get("overwrite") is True:
        raise ValueError(f"{path}: overwrite = true deletes the run already in run_dir; a file cannot ask for that: "
                         "remove it from the file and pass --overwrite on the command line")
    for f in OPTION_FIELDS:
        need(f.name not in data or of_kind(field_kind(f), data[f.name]),
             f"{path}: {f.name} must be a {field_kind(f)}, got {data.get(f.name)!r}")
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`config` (optional TOML path) plus one `--field-name` per option, defaulting to None (= not given)."""
    parser.add_argument("config", nargs="?", help="TOML file of options; command-line flags override it")
    for f in OPTION_FIELDS:
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
        if field_kind(f) == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}[field_kind(f)]
            parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)


def values_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options set by the TOML file, then by command-line flags (unset fields are absent: their defaults)."""
    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    for f in OPTION_FIELDS:
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    return values


def from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the TOML file, then command-line flags."""
    return TrainConfig.from_flat(values_from_args(args))
