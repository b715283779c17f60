"""Cost curves and tables from ``benchmarks/message_path.py``'s JSON results (one file per setting and
node count in a folder): seconds a round and MB/s against model size for every path; deployed
seconds a round against SuperNodes, this project's beside plain Flower FedAvg; one markdown table
per result. Written next to the JSON files:

    python benchmarks/message_path.py plot docs/figures/message-path
"""

from __future__ import annotations

import json
from pathlib import Path

#: the order and colours of the ways in every figure
STYLE = {"engine": ("engine", "black", "-"), "flwr": ("flwr run", "tab:blue", "-"),
         "deployed": ("deployed (ours)", "tab:green", "-"), "sums": ("deployed, node-aggregation", "tab:olive", "--"),
         "bf16": ("deployed, bfloat16", "tab:cyan", "--"), "sums-bf16": ("deployed, node-agg. + bf16", "tab:purple", "--"),
         "stock": ("deployed, Flower's stock isolation", "tab:orange", "-"),
         "plain": ("plain Flower FedAvg", "tab:red", "-"), "grpc": ("gRPC + TLS reference", "gray", ":")}


def load(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def table(result: dict) -> str:
    """One result as a markdown table, with what was measured and how."""
    head = (f"**{result['label']}**: {result['num-clients']} clients on {result['nodes']} SuperNodes"
            f"{' (network namespaces)' if result.get('netns') else ''}, I = {result['local-steps']}, "
            f"{result['rounds']} rounds (rounds 2.. timed); {result['model-bytes'] / 1e6:.1f} MB a model, "
            f"{result['bytes-per-round'] / 1e6:.0f} MB of model bytes a round. {result.get('date', '')}, "
            f"`{result.get('command', '')}`.\n\n")
    lines = ["| way | s/round | beyond the engine | MB/s | beyond its training | MB/s | model == engine |",
             "|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return "-" if v is None or v != v or v == float("inf") else format(v, fmt)

    for row in result["ways"].values():
        same = row.get("model == engine", "-")
        if row.get("model difference"):
            d = row["model difference"]
            same = f"no: max abs {d['max abs']:.2g}, {d['entries differing']:,} of {d['entries']:,} entries"
        lines.append(f"| {row['label']} | {f(row['s/round'], '.2f')} | {f(row.get('beyond'), '.2f')} | "
                     f"{f(row.get('MB/s'), '.0f')} | {f(row.get('beyond training'), '.2f')} | "
                     f"{f(row.get('MB/s beyond training'), '.0f')} | {same} |")
    memory = ["", "Peak resident memory (MiB, the largest process of its kind):", "",
              "| way | " + " | ".join(ROLES) + " |", "|---|" + "---|" * len(ROLES)]
    for row in result["ways"].values():
        if row.get("processes"):
            cells = [f"{row['processes'][r]['peak MiB']:.0f}" if r in row["processes"] else "-" for r in ROLES]
            memory.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    parts = [row for row in result["ways"].values() if row.get("parts")]
    where = []
    if parts:
        names = list(parts[0]["parts"])
        where = ["", "Where a deployed round's seconds go (means over rounds 2..; from time stamps; the nodes overlap, so "
                 "the parts need not add up to the round):", "", "| way | " + " | ".join(names) + " |",
                 "|---|" + "---|" * len(names)]
        for row in parts:
            where.append(f"| {row['label']} | " + " | ".join(f(row['parts'].get(n), '.2f') for n in names) + " |")
    load = result.get("load", "").replace("# ", "").replace("\n", " ")
    return head + "\n".join(lines) + "\n" + "\n".join(memory) + "\n" + "\n".join(where) + "\n\n" + load + "\n"


#: the processes shown in the memory tables
ROLES = ("engine", "ServerApp", "SuperLink", "SuperNode", "warm runner", "ClientApp worker (warm)",
         "ClientApp (flwr-clientapp)", "simulation (ServerApp + Ray driver)", "Ray worker")


def copies(results: list[dict]) -> str:
    """Each process's peak beyond the digits run's (the same process with a 0.1 MB model) in copies of the
    model, beside what ``server.memory`` plans for it (deployed ways on 2 SuperNodes)."""
    from server.memory import needs

    base = next((r for r in results if r["setting"] == "digits" and r["nodes"] == 2 and not r.get("netns")), None)
    if base is None:
        return ""
    roles = {"ServerApp": "ServerApp", "SuperLink": "SuperLink", "SuperNode": "SuperNode",
             "ClientApp worker (warm)": "ClientApp"}
    lines = ["| setting | way | " + " | ".join(f"{r}: measured / planned" for r in roles.values()) + " |",
             "|---|---|" + "---|" * len(roles)]
    for r in results:
        if r is base or r["nodes"] != 2 or r.get("netns"):
            continue
        m = r["model-bytes"]
        per_node = {n: r["num-clients"] // r["nodes"] + (n < r["num-clients"] % r["nodes"]) for n in range(r["nodes"])}
        for way, options in (("deployed", {}), ("sums", {"node_sums": True}), ("bf16", {"transport": "bfloat16"}),
                             ("sums-bf16", {"node_sums": True, "transport": "bfloat16"})):
            row, ref = r["ways"].get(way), base["ways"].get(way) or base["ways"].get("deployed")
            if not row or not ref or not row.get("processes"):
                continue
            plan = needs(m, per_node, node_sums=options.get("node_sums", False),
                         transport=options.get("transport", "float32"), server_host=None, node_host={})
            planned = {k: max(n.bytes for n in plan if n.process.split(" ")[0] == v) for k, v in roles.items()}
            cells = []
            for role in roles:
                if role in row["processes"] and role in ref["processes"]:
                    extra = (row["processes"][role]["peak MiB"] - ref["processes"][role]["peak MiB"]) * 2**20
                    cells.append(f"{extra / m:.1f} / {planned[role] / m:.1f}")
                else:
                    cells.append("-")
            lines.append(f"| {r['setting']} | {row['label']} | " + " | ".join(cells) + " |")
    return ("Memory beyond the same process in the digits run (0.1 MB model), in copies of the model: measured "
            "(peak resident memory) / planned by `server.memory` for the round:\n\n" + "\n".join(lines) + "\n")


def plot(folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load(folder)
    if not results:
        raise SystemExit(f"no results (*.json) in {folder}")
    for result in results:
        stem = f"{result['setting']}-{result['nodes']}nodes{'-netns' if result.get('netns') else ''}"
        (folder / f"{stem}.md").write_text(table(result))
    memory = copies(results)
    if memory:
        (folder / "memory.md").write_text(memory)
    by_size = sorted((r for r in results if r["nodes"] == 2 and not r.get("netns")), key=lambda r: r["parameters"])
    if len(by_size) >= 2:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for way, (label, colour, dash) in STYLE.items():
            points = [(r["parameters"], r["ways"][way]) for r in by_size if way in r["ways"]]
            if not points:
                continue
            xs = [p for p, _ in points]
            axes[0].plot(xs, [row["s/round"] for _, row in points], dash, marker="o", color=colour, label=label)
            rates = [(p, row.get("MB/s beyond training", row.get("MB/s"))) for p, row in points]
            rates = [(p, v) for p, v in rates if v is not None and v == v and v != float("inf")]
            if rates:
                axes[1].plot([p for p, _ in rates], [v for _, v in rates], dash, marker="o", color=colour, label=label)
        for ax, title in zip(axes, ("seconds a round", "MB/s of model bytes (beyond its training; engine: -)"),
                             strict=True):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("model parameters")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        date = by_size[-1].get("date", "")
        fig.suptitle(f"Cost against model size ({', '.join(r['setting'] for r in by_size)}; 2 SuperNodes; {date})")
        fig.tight_layout()
        fig.savefig(folder / "size.png", dpi=110)
        plt.close(fig)
    for netns in (False, True):
        sweep = sorted((r for r in results if bool(r.get("netns")) == netns), key=lambda r: r["nodes"])
        settings = {r["setting"] for r in sweep}
        for setting in settings:
            points = [r for r in sweep if r["setting"] == setting]
            if len({r["nodes"] for r in points}) < 2:
                continue
            fig, ax = plt.subplots(figsize=(6.5, 4.5))
            for way in ("deployed", "sums", "stock", "plain"):
                have = [(r["nodes"], r["ways"][way]["s/round"]) for r in points if way in r["ways"]]
                if have:
                    label, colour, dash = STYLE[way]
                    ax.plot([k for k, _ in have], [v for _, v in have], dash, marker="o", color=colour, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("SuperNodes" + (" (network namespaces)" if netns else ""))
            ax.set_ylabel("seconds a round")
            ax.set_title(f"{points[0]['label']}, {points[0]['num-clients']} clients ({points[-1].get('date', '')})")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(folder / f"nodes-{setting}{'-netns' if netns else ''}.png", dpi=110)
            plt.close(fig)
    print(f"written: {', '.join(sorted(p.name for p in folder.glob('*.png')))} and one .md table per result in {folder}")
