"""What a rank publishes before its engine's kernel exists goes nowhere and makes nothing:
ipyparallel's ``publish_data`` made the kernel's shell early, from the vitals thread, and the
kernel then found a shell with no kernel (``get_ipython().kernel`` None: starts failed when
clusters started side by side, issue 46). Each check runs in a fresh Python, since IPython's
shell is a process-wide singleton."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
from ipydist.rank import channel
import ipykernel.zmqshell as zmqshell
channel.publish("vitals", {"cpu": 1})  # before any kernel: the vitals thread's first beat
assert not zmqshell.ZMQInteractiveShell.initialized(), "publish made the shell"
class Kernel:  # the shell a kernel makes gets it, as ipykernel's IPythonKernel passes it
    pass
kernel = Kernel()
shell = zmqshell.ZMQInteractiveShell.instance(kernel=kernel)
assert shell.kernel is kernel
sent = []
shell.data_pub = type("Pub", (), {"publish_data": lambda self, data: sent.append(data)})()
channel.publish("cell", 3)
assert sent == [{"cell": 3}], sent
print("ok")
"""


def test_publishing_before_the_kernel_exists_makes_no_shell():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
