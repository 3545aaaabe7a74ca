"""Diagnosis for bench_scale_out (a): where a two-localhost-node SFT step could spend more than a one-node step.

Runs the bench's SFT config in the given layouts (``single``: one agent x 2 ranks; ``two``: two agents x 1 rank,
c10d on 127.0.0.1), optionally with extra environment (``two:PET_MONITOR_INTERVAL=5``), and samples ``/proc``
over a steady-state window (from step 20): wall seconds per step, each agent's and rank's CPU ms per step, the
ranks' voluntary/involuntary context switches per step (all threads), and the ranks' TCP connections (``ss``).
CPU and switch counts per step hardly move with other jobs' load, unlike wall time.

    python benchmarks/_scale_out_cpu.py /tmp/work single,two,two:PET_MONITOR_INTERVAL=5,single

Numbers and conclusions: docs/benchmarks.md, "scale_out".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import bench_scale_out as bench

from shardforge.algorithms.testing import tiny_assets

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str]:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()


def cpu_s(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / TICK


def switches(pid: int) -> tuple[int, int]:
    """Voluntary and involuntary context switches, summed over every thread of ``pid``."""
    voluntary = involuntary = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        for line in open(f"/proc/{pid}/task/{task}/status"):
            if line.startswith("voluntary_ctxt_switches"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                involuntary += int(line.split()[1])
    return voluntary, involuntary


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_stat(entry)[1]) == pid:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def steps_logged(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def measure(work: Path, assets: dict, index: int, item: str, window_s: float) -> dict:
    kind, *extra = item.split(":")
    name = f"{index}_{kind}"
    config = bench._config(work, assets, name)
    env = bench.ENV | dict(e.split("=", 1) for e in extra)
    if kind == "single":
        commands = [[*bench.CLI, "train", "sft", "--config", str(config), "--nproc-per-node", "2"]]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
        commands = [
            [*bench.CLI, "train", "sft", "--config", str(config), "--nproc-per-node", "1", "--nnodes", "2",
             "--node-rank", str(rank), "--rdzv-endpoint", endpoint]
            for rank in (1, 0)
        ]  # fmt: skip
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
    out = work / name
    try:
        while steps_logged(out) < 20:
            time.sleep(0.2)
        agents = [p.pid for p in procs]
        ranks = [c for a in agents for c in children(a)]
        ranks += [g for r in ranks for g in children(r)]  # multiprocessing spawn: keep every descendant
        load, t0, s0 = os.getloadavg()[0], time.time(), steps_logged(out)
        cpu0, sw0 = {p: cpu_s(p) for p in agents + ranks}, {p: switches(p) for p in ranks}
        time.sleep(window_s)
        t1, s1 = time.time(), steps_logged(out)
        cpu1, sw1 = {p: cpu_s(p) for p in agents + ranks}, {p: switches(p) for p in ranks}
        lines = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True).stdout.splitlines()
        tcp = sorted({" ".join(line.split()[3:5]) for line in lines if any(f"pid={p}," in line for p in ranks)})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    steps = max(s1 - s0, 1)
    return {
        "run": item, "load1": round(load, 2), "steps": steps, "wall_s_per_step": round((t1 - t0) / steps, 4),
        "agents_cpu_ms_per_step": [round(1000 * (cpu1[p] - cpu0[p]) / steps, 2) for p in agents],
        "ranks_cpu_ms_per_step": [round(1000 * (cpu1[p] - cpu0[p]) / steps, 2) for p in ranks],
        "ranks_switches_per_step": [[round((sw1[p][k] - sw0[p][k]) / steps, 1) for k in (0, 1)] for p in ranks],
        "ranks_tcp": tcp,
    }  # fmt: skip


def main() -> None:
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    bench.STEPS = 200  # the window ends long before; the runs are stopped after it
    assets = tiny_assets(work / "assets")
    for index, item in enumerate(sys.argv[2].split(",")):
        print(json.dumps(measure(work, assets, index, item, float(os.environ.get("WINDOW_S", "8")))), flush=True)


if __name__ == "__main__":
    main()
