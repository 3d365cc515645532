"""How fast Tab and Shift-Tab answer for code that runs on the ranks, against the same
request answered by the notebook's own kernel, in the same run, through a real Jupyter kernel
(jupyter_client, as JupyterLab asks).

1. Idle ranks, interleaved: ``complete_request`` for ``model.para`` in a plain cell (the
   notebook kernel's jedi, on a ``model`` of its own) against ``%%everyrank\\nmodel.para``
   (rank 0's, asked on its control channel); the same for ``inspect_request`` on ``model``.
2. While a training cell runs on every rank: the everyrank completion sent to a subshell of
   the kernel (ipykernel 7), as a front end that uses subshells sends it.

Printed: median and p95 in ms, and the ratios to local completion.

    .venv/bin/python benchmarks/completion.py [--np 4] [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

from jupyter_client.manager import start_new_kernel

DEFINE = "import torch\nmodel = torch.nn.Linear(4, 2)"
TRAIN = """%%everyrank
import torch, ipydist.torch as hvd
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01))
for _ in range({steps}):
    opt.zero_grad()
    net(torch.randn(32, 64)).square().mean().backward()
    opt.step()
"""


def run(kc, code: str) -> None:
    reply = kc.execute_interactive(code, timeout=600, output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", (code, reply["content"])


def ask(kc, msg_type: str, code: str, subshell: str | None = None) -> tuple[float, dict]:
    """(ms until the reply, its content) for one request of ``msg_type`` about ``code``."""
    request = kc.session.msg(msg_type, {"code": code, "cursor_pos": len(code),
                                        "detail_level": 0})
    if subshell:
        request["header"]["subshell_id"] = subshell
    t0 = time.perf_counter()
    kc.shell_channel.send(request)
    while True:
        reply = kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == request["header"]["msg_id"]:
            return (time.perf_counter() - t0) * 1e3, reply["content"]


def p95(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def line(name: str, values: list[float], against: list[float] | None = None) -> str:
    text = f"{name:<44} median {statistics.median(values):7.2f} ms   p95 {p95(values):7.2f} ms"
    if against:
        text += f"   {statistics.median(values) / statistics.median(against):5.2f}x local"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run(kc, f"%load_ext ipydist\n%dist_start --np {args.np}")
        run(kc, DEFINE)
        run(kc, "%%everyrank\n" + DEFINE)
        times: dict[str, list[float]] = {k: [] for k in (
            "complete, notebook", "complete, rank 0", "inspect, notebook", "inspect, rank 0",
            "complete, rank 0, while a cell trains")}
        for _ in range(2):  # jedi's caches, on both sides
            ask(kc, "complete_request", "model.para")
            ask(kc, "complete_request", "%%everyrank\nmodel.para")
        for _ in range(args.rounds):
            for key, msg_type, code in (
                    ("complete, notebook", "complete_request", "model.para"),
                    ("complete, rank 0", "complete_request", "%%everyrank\nmodel.para"),
                    ("inspect, notebook", "inspect_request", "model"),
                    ("inspect, rank 0", "inspect_request", "%%everyrank\nmodel")):
                ms, content = ask(kc, msg_type, code)
                ok = "parameters" in content.get("matches", ()) or content.get("found")
                assert ok, (code, content)
                times[key].append(ms)
        control = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(control)
        subshell = kc.control_channel.get_msg(timeout=10)["content"]["subshell_id"]
        main_cell = kc.execute(TRAIN.format(steps=10**6))
        time.sleep(3)
        for _ in range(args.rounds):
            ms, content = ask(kc, "complete_request", "%%everyrank\nmodel.para", subshell)
            assert "parameters" in content["matches"], content
            times["complete, rank 0, while a cell trains"].append(ms)
            time.sleep(0.05)
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=120)
            if reply["parent_header"].get("msg_id") == main_cell:
                break
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    print(f"np={args.np}, {args.rounds} rounds, interleaved")
    print(line("complete, notebook (model.para)", times["complete, notebook"]))
    print(line("complete, rank 0 (%%everyrank model.para)", times["complete, rank 0"],
               times["complete, notebook"]))
    print(line("inspect, notebook (model)", times["inspect, notebook"]))
    print(line("inspect, rank 0", times["inspect, rank 0"], times["inspect, notebook"]))
    print(line("complete, rank 0, while a cell trains",
               times["complete, rank 0, while a cell trains"], times["complete, notebook"]))


if __name__ == "__main__":
    main()
