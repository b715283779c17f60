"""Soak: a deployment that survives faults for hundreds of rounds, and loses nothing (issue 38).

    sudo python benchmarks/soak.py --rounds 200 --faults 24 --seed 0 --out docs/figures/soak

A TLS deployment across network namespaces (``simulations.flower.netns``: a SuperLink host and
``--nodes`` SuperNode hosts on a private subnet; SuperNode authentication, this project's warm
ClientApp runner with one torch thread a node, packed messages; the SuperLink's state in a database
file) runs one run of the default digits setting for ``--rounds`` rounds, submitted by
``server/deploy/submit.sh --restarts``, while a seeded schedule injects faults one after another:

* ``supernode-kill``    SIGKILL to a host's SuperNode (its script, runner and workers), restarted
                        after a few seconds with the same key (``--rejoin-retries``: the SuperLink
                        refuses the key until it marked the dead node offline, up to 60 s);
* ``worker-kill``       SIGKILL to the warm runner's worker of a host (the runner answers its message
                        with an error reply, if it had one, and forks a new worker);
* ``link-down``         the host's link down for 5-30 s (``ip link set ... down`` in its namespace);
* ``link-throttle``     the host's link throttled to 1 Mbit/s by ``tc`` tbf for 15-40 s;
* ``superlink-restart`` the server host dies (SIGKILL to the SuperLink with its SuperExec and
                        ServerApp) and comes back on the same database file; submit.sh resumes the run;
* ``serverapp-kill``    SIGKILL to the run's ServerApp mid-round; submit.sh resumes the run.

At most one fault acts at a time (a restarted SuperNode counts until it is online again), so
``min-replies`` (half the nodes) always holds. What is checked and written to ``--out``:

* ``summary.json``: ``rounds`` (of the finished run), ``fault-kinds`` (kind -> count), ``rows-lost`` and
  ``rows-duplicated`` (round rows of ``results.jsonl`` missing, or there more than once),
  ``model-equals-simulation`` (the final model against the in-process apps replaying the run with
  exactly the clients its rows name as failed, round by round: ``simulations.replay``, bit for bit),
  ``rss-growth`` (the largest relative growth of the resident memory of a long-lived process: one that
  lived at least ``--rss-span`` rounds after round 50, or after its own 20th round if it started later
  (a restarted process warms up first); median of its first 5 samples there against its last 5), and
  what ran: the faults one by one, restarts, rounds each client missed, date, command, machine;
* ``timeline.png``: each round's wall time (from its row appearing to the next) with the faults
  marked, and the resident memory of the long-lived processes.

Every loop is bounded in count and time (``--budget`` seconds for the whole soak, 45 min by default);
traffic stays on loopback and the namespaces made here; every process and namespace is removed at
the end, also on failure or SIGTERM. Needs root (network namespaces), openssl, iproute2 (ip, tc).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.process_monitor import role_of  # noqa: E402
from simulations.flower.deploy import Deployment, Namespaces  # noqa: E402
from simulations.flower.processes import cmdline, process_tree  # noqa: E402
from simulations.replay import missed_rounds, model_differences, replay, row_accounting  # noqa: E402
from tasks.runs import stamps  # noqa: E402
from tasks.runs.results import parse_lines, read_results  # noqa: E402

KINDS = ("supernode-kill", "worker-kill", "link-down", "link-throttle", "superlink-restart", "serverapp-kill")
SERVER_KINDS = ("superlink-restart", "serverapp-kill")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Fault:
    kind: str
    at_round: int  # scheduled: not before this round's row
    host: int | None = None
    seconds: float = 0.0  # how long the link stays down / throttled, or the SuperNode stays dead
    started: float | None = None  # seconds since the soak's start
    ended: float | None = None
    round_started: int | None = None
    round_ended: int | None = None
    note: str = ""


def schedule(seed: int, rounds: int, count: int, kinds: tuple[str, ...], nodes: int) -> list[Fault]:
    """``count`` faults, the kinds as even as the count allows, at distinct rounds in [5, rounds - 10],
    in a seeded order; hosts and durations drawn from the same generator."""
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(order)
    at = sorted(rng.sample(range(5, max(6, rounds - 10)), count))
    faults = []
    for kind, r in zip(order, at, strict=True):
        host = None if kind in SERVER_KINDS else rng.randrange(nodes)
        seconds = {"link-down": rng.uniform(5, 30), "link-throttle": rng.uniform(15, 40),
                   "supernode-kill": rng.uniform(2, 10)}.get(kind, 0.0)
        faults.append(Fault(kind, r, host, round(seconds, 1)))
    return faults


class Soak:
    def __init__(self, args: argparse.Namespace, root: Path, ns: Namespaces, d: Deployment) -> None:
        self.args, self.root, self.ns, self.d = args, root, ns, d
        self.folder = root / "results" / "soak"
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        self.seen: dict[int, float] = {}  # round -> when its (last) row appeared
        self.rss: dict[int, dict[str, Any]] = {}  # pid -> role, samples [(round, bytes)]
        self.last_sample = 0.0
        self.submit = None
        self.restarts_of: dict[int, int] = {}

    # --- watching ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def rows(self) -> list[dict]:
        try:
            return [obj for _, _, obj in parse_lines(self.folder / "results.jsonl", torn_ok=True)
                    if obj.get("kind") == "round"]
        except (OSError, ValueError):
            return []

    def round(self) -> int:
        rows = self.rows()
        return max((int(r["round"]) for r in rows), default=-1)

    def watch(self, seconds: float) -> None:
        """Follow the rows and sample memory for ``seconds`` (never past the budget)."""
        end = min(time.monotonic() + seconds, self.deadline)
        while True:
            rows = self.rows()
            present = {int(r["round"]) for r in rows}
            for k in present - set(self.seen):
                self.seen[k] = self.now()
            for k in set(self.seen) - present:  # dropped by a resume, to be redone
                del self.seen[k]
            if time.monotonic() - self.last_sample >= self.args.sample_every:
                self.sample(max(present, default=-1))
            if time.monotonic() >= end:
                return
            time.sleep(0.25)

    def sample(self, current: int) -> None:
        self.last_sample = time.monotonic()
        for pid in process_tree([p.pid for p in self.d.procs if p.alive()], tag=self.d.tag):
            try:
                rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            entry = self.rss.get(pid)
            if entry is None:
                argv = " ".join(cmdline(pid))
                role = role_of(argv)
                if role == "warm runner" and "warm_runner.py" in " ".join(cmdline(ppid)):
                    role = "warm worker"
                if role.startswith("other") or role == "warm worker" and rss < 50 * 2**20:
                    continue  # scripts, CLIs, short-lived forks answering a dead worker's message
                entry = self.rss[pid] = {"role": role, "samples": []}
            entry["samples"].append((current, rss))

    def wait_round(self, k: int, limit: float) -> bool:
        """Until round ``k``'s row is there (bounded by ``limit`` s and the budget); whether it came."""
        end = min(time.monotonic() + limit, self.deadline)
        while time.monotonic() < end:
            if self.round() >= k:
                return True
            if self.submit is not None and not self.submit.alive():
                return False
            self.watch(1.0)
        return self.round() >= k

    # --- faults -------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> None:
        fault.started, fault.round_started = self.now(), self.round()
        getattr(self, "_" + fault.kind.replace("-", "_"))(fault)
        fault.ended, fault.round_ended = self.now(), self.round()
        print(f"[{fault.ended:7.1f} s] {fault.kind}{'' if fault.host is None else f' host {fault.host}'} at round "
              f"{fault.round_started} -> {fault.round_ended} ({fault.ended - fault.started:.1f} s) {fault.note}",
              flush=True)

    def _ns_run(self, i: int, *cmd: str) -> None:
        subprocess.run([*self.ns.prefix(self.ns.clients[i]), *cmd], check=True, capture_output=True, timeout=20)

    def _link_down(self, f: Fault) -> None:
        dev = self.ns.client_ifname(f.host)
        self._ns_run(f.host, "ip", "link", "set", dev, "down")
        try:
            self.watch(f.seconds)
        finally:
            self._ns_run(f.host, "ip", "link", "set", dev, "up")

    def _link_throttle(self, f: Fault) -> None:
        dev = self.ns.client_ifname(f.host)
        self._ns_run(f.host, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "1mbit", "burst", "32kbit",
                     "latency", "400ms")
        try:
            self.watch(f.seconds)
        finally:
            self._ns_run(f.host, "tc", "qdisc", "del", "dev", dev, "root")

    def _supernode_kill(self, f: Fault) -> None:
        self.d.nodes[f.host].signal(signal.SIGKILL)
        self.d.nodes[f.host].wait_exit(30)
        self.watch(f.seconds)
        self.restarts_of[f.host] = self.restarts_of.get(f.host, 0) + 1
        self.start_node(f.host, f"supernode-{f.host}-r{self.restarts_of[f.host]}")
        proc = self.d.nodes[f.host]
        end = min(time.monotonic() + 240, self.deadline)  # refused until the dead one is marked offline (<= 60 s)
        while time.monotonic() < end and proc.alive() and not self.node_serves(proc):
            self.watch(2.0)
        f.note = "back online" if self.node_serves(proc) else "NOT back online within 240 s"

    @staticmethod
    def node_serves(proc) -> bool:
        """Whether a (re)started SuperNode got past its activation (Flower logs its node id then)."""
        return "SuperNode ID:" in proc.output()

    def _worker_kill(self, f: Fault) -> None:
        tree = process_tree([self.d.nodes[f.host].pid])
        warm = {p for p in tree if "warm_runner.py" in " ".join(cmdline(p))}  # the runner and its forks
        workers = sorted(p for p in warm if _ppid(p) in warm)
        if not workers:
            f.note = "no worker alive (between runs)"
            return
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        f.note = f"killed worker(s) {workers}"
        self.watch(1.0)

    def _serverapp_kill(self, f: Fault) -> None:
        before = self.round()
        end = min(time.monotonic() + 60, self.deadline)
        while not (apps := self.serverapps()) and time.monotonic() < end:
            self.watch(1.0)
        for pid in apps:
            os.kill(pid, signal.SIGKILL)
        f.note = f"killed ServerApp(s) {apps}" if apps else "no ServerApp found within 60 s"
        self.wait_round(before + 1, 420)

    def _superlink_restart(self, f: Fault) -> None:
        before = self.round()
        self.d.superlink.signal(signal.SIGKILL)
        self.d.superlink.wait_exit(30)
        self.watch(3.0)
        self.d.start_superlink(timeout=120)
        f.note = "SuperLink back on its database"
        self.wait_round(before + 1, 420)

    def serverapps(self) -> list[int]:
        tree = process_tree([self.d.superlink.pid]) if self.d.superlink is not None else {}
        return [p for p in tree if "flwr-serverapp" in " ".join(cmdline(p))]

    def start_node(self, i: int, name: str) -> None:
        self.d.start_supernode(i, partition=i, num_partitions=self.args.nodes, name=name,
                               options=["--threads", "1", "--rejoin-retries", "40", "--rejoin-delay", "5"],
                               env={"TMPDIR": str(self.root / "tmp"),
                                    "CELGC_STAMPS": str(self.root / f"stamps-host{i}.jsonl")})


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def rss_growth(rss: dict[int, dict[str, Any]], start: int, warmup: int, span: int) -> list[dict[str, Any]]:
    """Per long-lived process: resident memory from round max(start, its first + warmup) to its end."""
    out = []
    for pid, entry in rss.items():
        samples = sorted(entry["samples"])
        if not samples:
            continue
        begin = max(start, samples[0][0] + warmup)
        window = [s for s in samples if s[0] >= begin]
        if len(window) < 10 or window[-1][0] - begin < span:
            continue
        first = statistics.median(r for _, r in window[:5])
        last = statistics.median(r for _, r in window[-5:])
        out.append({"pid": pid, "role": entry["role"], "from-round": window[0][0], "to-round": window[-1][0],
                    "rss-start-mib": round(first / 2**20, 1), "rss-end-mib": round(last / 2**20, 1),
                    "rss-max-mib": round(max(r for _, r in window) / 2**20, 1),
                    "growth": round(last / first - 1, 4)})
    return sorted(out, key=lambda e: -e["growth"])


def message_differences(deployed: Path, replayed: Path, missed: dict[int, set[int]] | None = None,
                        limit: int = 20) -> list[dict[str, Any]]:
    """The messages (round, direction, partition) whose arrays differ between the deployed run and its
    replay, from the ServerApp's digests (``server.faults``: ``sent`` / ``received`` stamps; of a round
    redone after a restart, the last). Error replies and messages to offline clients have no twin: a
    client's messages of a round the rows name it failed in (``missed``) are not compared."""
    failed = {(r, str(p)) for p, rounds in (missed or {}).items() for r in rounds}
    def table(path: Path) -> dict[tuple, str]:
        out = {}
        for m in stamps.read(path) if path.exists() else []:
            if m.get("event") in ("sent", "received") and m.get("round") is not None:
                out[(m["round"], m["event"], str(m.get("to", m.get("frm"))))] = m["digest"]
        return out
    a, b = table(deployed), table(replayed)
    diff = [{"round": k[0], "message": k[1], "partition": k[2], "deployed": a[k], "replay": b[k]}
            for k in sorted(set(a) & set(b)) if a[k] != b[k] and (k[0], k[2]) not in failed]
    return diff[:limit]


def machine() -> str:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.system()} {platform.release()}, {os.cpu_count()} cores ({model}), {mem:.0f} GiB"


def figure(path: Path, seen: dict[int, float], faults: list[Fault], processes: list[dict[str, Any]],
           rss: dict[int, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = sorted(seen)
    times = [(k, seen[k] - seen[k - 1]) for k in rounds if k - 1 in seen]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=[3, 2])
    top.plot([k for k, _ in times], [t for _, t in times], lw=0.8, color="0.2", label="round wall time")
    top.set_yscale("log")
    top.set_ylabel("seconds (row to row)")
    colors = dict(zip(KINDS, ["tab:red", "tab:orange", "tab:blue", "tab:cyan", "tab:purple", "tab:green"], strict=True))
    shown = set()
    for f in faults:
        if f.round_started is None:
            continue
        top.axvspan(f.round_started + 0.5, max(f.round_ended or f.round_started, f.round_started) + 1.5,
                    color=colors[f.kind], alpha=0.25, lw=0, label=None if f.kind in shown else f.kind)
        shown.add(f.kind)
    top.legend(loc="upper right", fontsize=7, ncol=2)
    top.set_title("soak: round wall time, faults shaded from the round they hit to the round they ended")
    for p in processes:
        samples = sorted(rss[p["pid"]]["samples"])
        bottom.plot([r for r, _ in samples], [b / 2**20 for _, b in samples], lw=0.8, label=f"{p['role']} {p['pid']}")
    bottom.set_ylabel("resident MiB")
    bottom.set_xlabel("round")
    bottom.legend(loc="upper left", fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recheck(kept: Path, out: Path) -> int:
    """The replay of a kept soak run again, with this code (a fix of the replay): ``summary.json``'s
    ``model-equals-simulation``, ``model-differences`` and ``message-differences`` rewritten, the
    earlier values kept under ``before-recheck`` with the date."""
    summary = json.loads((out / "summary.json").read_text())
    folder = kept / "results" / "soak"
    _, rows = read_results(folder / "results.jsonl")
    os.environ[stamps.ENV] = str(kept / "stamps-recheck.jsonl")
    (kept / "stamps-recheck.jsonl").unlink(missing_ok=True)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    differences = model_differences(folder, replay(folder, kept / "recheck", threads=1))
    os.environ.pop(stamps.ENV, None)
    keys = ("model-equals-simulation", "model-differences", "message-differences")
    before = {k: summary.get(k) for k in keys}
    summary.update({"model-equals-simulation": differences == {}, "model-differences": differences,
                    "message-differences": message_differences(kept / "stamps-server.jsonl",
                                                               kept / "stamps-recheck.jsonl", missed_rounds(rows))})
    summary.setdefault("rechecks", []).append({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "before": before,
                                               "command": " ".join(["benchmarks/soak.py", "--recheck", str(kept.name),
                                                                    "--out", str(out)])})
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("model-equals-simulation", "model-differences")}))
    return 0 if differences == {} else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--faults", type=int, default=24)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--round-timeout", type=float, default=15.0)
    p.add_argument("--budget", type=float, default=2700.0, help="seconds for the whole soak (default 45 min)")
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between memory samples")
    p.add_argument("--rss-from", type=int, default=50)
    p.add_argument("--rss-span", type=int, default=50)
    p.add_argument("--out", default=str(ROOT / "docs" / "figures" / "soak"))
    p.add_argument("--keep", help="keep the soak's files (logs, results) in this folder")
    p.add_argument("--recheck", metavar="KEPT", help="no soak: replay the run kept in KEPT (a --keep folder) again "
                   "and rewrite --out's summary.json's replay fields (model and message differences)")
    args = p.parse_args(argv)
    if args.recheck:
        return recheck(Path(args.recheck), Path(args.out))
    kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        p.error(f"--kinds: unknown {bad or 'none given'}; known: {', '.join(KINDS)}")
    if args.nodes < 2 or args.rounds < 20 or args.faults < 0 or args.faults > args.rounds - 15:
        p.error("--nodes >= 2, --rounds >= 20 and 0 <= --faults <= rounds - 15")
    why = Namespaces.unavailable_reason()
    if why:
        p.error(f"network namespaces: {why}")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # clean up on SIGTERM
    root = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="celgc-soak-"))
    (root / "tmp").mkdir(parents=True, exist_ok=True)
    faults = schedule(args.seed, args.rounds, args.faults, kinds, args.nodes)
    config = {"num-clients": args.nodes, "num-rounds": args.rounds, "min-replies": max(1, args.nodes // 2),
              "round-timeout": args.round_timeout, "node-wait": 20.0, "eval-every": 10, "checkpoint-every": 1,
              "device": "cpu", "results-dir": str(root / "results"), "run-name": "soak"}
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    print(f"soak in {root}: {args.rounds} rounds, {len(faults)} faults: "
          f"{dict(Counter(f.kind for f in faults))}", flush=True)
    submit_code, submit_out = None, ""
    os.environ[stamps.ENV] = str(root / "stamps-server.jsonl")  # the ServerApp's digests of what it sent and got
    with Namespaces(num_clients=args.nodes) as ns, Deployment(root / "dep", num_keys=args.nodes, netns=ns) as d:
        soak = Soak(args, root, ns, d)
        d.start_superlink()
        for i in range(args.nodes):
            d.register(i)
            soak.start_node(i, f"supernode-{i}")
        soak.submit = d.submit_in_background(config, args.budget, restarts=4 * len(faults) + 5, restart_delay=5)
        for fault in faults:
            if not soak.wait_round(fault.at_round, max(0.0, soak.deadline - time.monotonic())):
                break
            soak.inject(fault)
        end = soak.deadline
        while soak.submit.alive() and time.monotonic() < end:
            soak.watch(2.0)
        soak.watch(0.5)
        if soak.submit.alive():
            print("soak: the run did not finish within --budget", flush=True)
        else:
            submit_code = soak.submit.popen.returncode
        submit_out = soak.submit.output()
        logs = {proc.name: proc.tail(15) for proc in d.procs}
    wall = soak.now()
    header, rows = read_results(soak.folder / "results.jsonl")
    last = max((int(r["round"]) for r in rows), default=0)
    counted = row_accounting(rows, last)
    missed = missed_rounds(rows)
    differences = None
    if submit_code == 0:
        os.environ[stamps.ENV] = str(root / "stamps-replay.jsonl")
        logging.getLogger("flwr").setLevel(logging.WARNING)  # the replay's round log is the run's again
        differences = model_differences(soak.folder, replay(soak.folder, root / "replay", threads=1))
    os.environ.pop(stamps.ENV, None)
    messages = message_differences(root / "stamps-server.jsonl", root / "stamps-replay.jsonl", missed)
    processes = rss_growth(soak.rss, args.rss_from, 20, args.rss_span)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = [f for f in faults if f.started is not None]
    summary = {
        "rounds": last if submit_code == 0 else None,
        "fault-kinds": dict(Counter(f.kind for f in done)),
        "rows-lost": counted["rows-lost"],
        "rows-duplicated": counted["rows-duplicated"],
        "model-equals-simulation": differences == {} if differences is not None else None,
        "rss-growth": max((e["growth"] for e in processes), default=None),
        "faults": len(done),
        "restarts": len(re.findall(r"^submit\.sh: restart \d+/", submit_out, re.M)),
        "runs": len(re.findall(r"^run-id \d+$", submit_out, re.M)),
        "submit-exit": submit_code,
        "client-rounds-missed": {str(k): len(v) for k, v in sorted(missed.items())},
        "model-differences": differences,
        "message-differences": messages,
        "round-seen-seconds": {str(k): round(v, 2) for k, v in sorted(soak.seen.items())},
        "rss-processes": processes,
        "rss-definition": f"processes living >= {args.rss_span} rounds from round max({args.rss_from}, their first + 20); "
                          "median of the first 5 samples there vs the last 5",
        "wall-seconds": round(wall, 1),
        "date": started,
        "command": " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], "benchmarks/soak.py",
                                                       *(sys.argv[1:] if argv is None else argv)]),
        "code": header.get("source"),
        "machine": machine(),
        "config": {k: v for k, v in config.items() if k not in ("results-dir",)},
        "seed": args.seed,
        "fault-log": [asdict(f) for f in faults],
        "lost-rounds": counted["lost-rounds"],
        "duplicated-rounds": counted["duplicated-rounds"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    figure(out / "timeline.png", soak.seen, done, processes, soak.rss)
    print(json.dumps({k: summary[k] for k in ("rounds", "fault-kinds", "rows-lost", "rows-duplicated",
                                              "model-equals-simulation", "rss-growth", "restarts", "wall-seconds")}))
    if submit_code != 0:
        print("--- submit.sh ---\n" + "\n".join(submit_out.splitlines()[-40:]))
        for name, text in logs.items():
            print(f"--- {name} ---\n{text}")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    ok = (submit_code == 0 and summary["rows-lost"] == 0 and summary["rows-duplicated"] == 0
          and summary["model-equals-simulation"] is True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
