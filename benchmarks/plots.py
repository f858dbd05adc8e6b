"""PNG plots of benchmark result documents (matplotlib, Agg backend). Each function returns the path written,
or None with a note on stderr when matplotlib is missing or no configuration succeeded."""

from __future__ import annotations

from longstraw.planner import MIB
from longstraw.train.reporting import pyplot as _pyplot  # the core's matplotlib set-up (Agg, note when missing)


def _ok(results: list[dict]) -> list[dict]:
    return [r for r in results if r.get("status") == "ok"]


def _series(results: list[dict], plan: str, x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    pts = sorted((r[x_key], r[y_key]) for r in _ok(results) if r["plan"] == plan)
    return [p[0] for p in pts], [p[1] for p in pts]


def _two_panels(document: dict, path: str, x_key: str, x_label: str, title: str, budget: int | None = None):
    plt = _pyplot()
    results = document["results"]
    if plt is None or not _ok(results):
        return None
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for plan in dict.fromkeys(r["plan"] for r in results):
        xs, peaks = _series(results, plan, x_key, "peak_bytes")
        _, times = _series(results, plan, x_key, "time_s")
        if xs:
            ax_mem.plot(xs, [p / MIB for p in peaks], marker="o", label=plan)
            ax_time.plot(xs, times, marker="o", label=plan)
    if budget:
        ax_mem.axhline(budget / MIB, color="red", linestyle="--", linewidth=1, label="budget")
    for ax, label in ((ax_mem, "peak step memory (MiB)"), (ax_time, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    machine = document.get("machine", {})
    fig.suptitle(f"{title} — {machine.get('cpu_model', machine.get('device', ''))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(document: dict, path: str) -> str | None:
    """Bench B1: peak and step time vs G, one line per plan."""
    cfg = document["config"]
    title = f"bench memory: {cfg['model']} P={cfg['prompt_tokens']} R={cfg['response_tokens']}"
    return _two_panels(document, path, "group_size", "group size G", title)


def plot_prompt(document: dict, path: str) -> str | None:
    """Prompt sweep: peak and step time vs P, one line per plan, the budget as a red line."""
    cfg = document["config"]
    title = f"bench prompt: {cfg['model']} R={cfg['response_tokens']} G={cfg['group_size']}"
    return _two_panels(document, path, "prompt_tokens", "prompt tokens P", title, budget=cfg.get("budget_bytes"))


# Marker per lever combination in the pareto plot (suffix of the point labels: +ck, +off).
_LEVER_MARKERS = {"": "o", "+ck": "^", "+off": "s", "+ck+off": "D", "+keep": "*", "+ck+keep": "P", "+off+keep": "X",
                  "+ck+off+keep": "h"}


def _lever(r: dict) -> str:
    """"", "+ck", "+off" or "+ck+off": the memory levers of a result (older files have neither key)."""
    return (("+ck" if r.get("checkpoint", "none") != "none" else "") + ("+off" if r.get("offload_state") else "")
            + ("+keep" if r.get("keep_prompt_graph") else ""))


def plot_pareto(document: dict, path: str) -> str | None:
    """Time vs peak for every (plan, micro_batch, chunk_size, lever); one colour per plan, one marker per lever
    (labels k<micro_batch>/c<chunk>[+ck][+off]); the Pareto front of each plan, levers included, as a line."""
    plt = _pyplot()
    ok = _ok(document["results"])
    if plt is None or not ok:
        return None
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, plan in enumerate(dict.fromkeys(r["plan"] for r in ok)):
        color = f"C{i}"
        pts = [r for r in ok if r["plan"] == plan]
        for lever in dict.fromkeys(_lever(r) for r in pts):
            mine = [r for r in pts if _lever(r) == lever]
            ax.scatter([r["peak_bytes"] / MIB for r in mine], [r["time_s"] for r in mine], color=color,
                       marker=_LEVER_MARKERS.get(lever, "x"), label=f"{plan}{lever}")
        for r in pts:
            ax.annotate(f"k{r['micro_batch']}/c{r['chunk_size']}{_lever(r)}", (r["peak_bytes"] / MIB, r["time_s"]),
                        fontsize=6, alpha=0.7)
        front = sorted((r for r in pts if r.get("pareto")), key=lambda r: r["peak_bytes"])
        ax.plot([r["peak_bytes"] / MIB for r in front], [r["time_s"] for r in front], color=color, linewidth=1)
    cfg = document["config"]
    ax.set_xlabel("peak step memory (MiB)")
    ax.set_ylabel("step time (s)")
    ax.set_title(f"bench pareto: {cfg['model']} P={cfg['prompt_tokens']} R={cfg['response_tokens']} "
                 f"G={cfg['group_size']}\nk = micro-batch, c = chunk, +ck = per-layer checkpointing, "
                 "+off = prompt state offloaded", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_arch(document: dict, path: str) -> str | None:
    """Peak memory per plan, grouped by architecture, at the largest G measured."""
    plt = _pyplot()
    ok = _ok(document["results"])
    if plt is None or not ok:
        return None
    g = max(r["group_size"] for r in ok)
    archs = list(dict.fromkeys(r["arch"] for r in document["results"]))
    plans = list(dict.fromkeys(r["plan"] for r in document["results"]))
    fig, ax = plt.subplots(figsize=(max(6, 2 + 1.8 * len(archs)), 4.2))
    width = 0.8 / len(plans)
    for j, plan in enumerate(plans):
        heights = []
        for arch in archs:
            hit = [r for r in ok if r["arch"] == arch and r["plan"] == plan and r["group_size"] == g]
            heights.append(hit[0]["peak_bytes"] / MIB if hit else 0.0)
        ax.bar([i + j * width for i in range(len(archs))], heights, width, label=plan)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(archs))], archs)
    ax.set_ylabel(f"peak step memory at G={g} (MiB)")
    ax.set_yscale("log")
    ax.set_title("bench arch: B1 shape per architecture family", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
