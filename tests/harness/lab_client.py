"""Run cells in a kernel of a JupyterLab server over its REST API and kernel websocket, as the
page would, where no browser can reach the server: a server on a test host (a Slurm node of
tests/harness/slurm_cluster.py), driven by this program run on another test host.

    python lab_client.py URL TOKEN CELLS_JSON TIMEOUT

starts a kernel (``POST /api/kernels``), runs each cell of the JSON list in turn on the kernel's
``/channels`` websocket, and prints one JSON line per cell: ``{"cell": i, "text": ...,
"error": ...}`` (``text``: its streams and the ``text/plain`` of its results and displays, in
order; ``error``: ``"ename: evalue"`` or None). It stops at the first cell that fails, then shuts
the kernel down (``DELETE``). Waits for the server to answer first (up to TIMEOUT seconds).

The requests allow no stdin, as nbclient's do. Only tornado (jupyter_server's own dependency) and
the standard library are imported.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from datetime import datetime, timezone

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect


def execute_request(code: str, session: str) -> dict:
    return {
        "header": {"msg_id": uuid.uuid4().hex, "msg_type": "execute_request",
                   "username": "test", "session": session, "version": "5.3",
                   "date": datetime.now(timezone.utc).isoformat()},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": True,
                    "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
    }


async def wait_serving(http, url: str, headers: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await http.fetch(f"{url}/api/status", headers=headers, request_timeout=5)
            return
        except (OSError, HTTPClientError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def run_cell(ws, code: str, session: str, timeout: float) -> dict:
    request = execute_request(code, session)
    await ws.write_message(json.dumps(request))
    text, error = [], None
    deadline = time.monotonic() + timeout
    while True:
        raw = await asyncio.wait_for(ws.read_message(), max(0.1, deadline - time.monotonic()))
        if raw is None:
            raise ConnectionError("the kernel's websocket closed")
        if isinstance(raw, bytes):  # a message with binary buffers (a widget's): not text
            continue
        msg = json.loads(raw)
        if msg["parent_header"].get("msg_id") != request["header"]["msg_id"]:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text.append(content["text"])
        elif kind in ("execute_result", "display_data"):
            text.append(content["data"].get("text/plain", "") + "\n")
        elif kind == "error":
            error = f"{content['ename']}: {content['evalue']}"
        elif kind == "status" and content["execution_state"] == "idle":
            return {"text": "".join(text), "error": error}


async def main(url: str, token: str, cells: list[str], timeout: float) -> None:
    http = AsyncHTTPClient()
    headers = {"Authorization": f"token {token}"}
    await wait_serving(http, url, headers, timeout)
    made = await http.fetch(f"{url}/api/kernels", method="POST", headers=headers,
                            body=json.dumps({"name": "python3"}))
    kernel = json.loads(made.body)["id"]
    session = uuid.uuid4().hex
    try:
        ws = await websocket_connect(HTTPRequest(
            f"ws{url[len('http'):]}/api/kernels/{kernel}/channels?session_id={session}",
            headers=headers))
        for i, code in enumerate(cells):
            out = await run_cell(ws, code, session, timeout)
            print(json.dumps({"cell": i, **out}), flush=True)
            if out["error"]:
                break
        ws.close()
    finally:
        await http.fetch(f"{url}/api/kernels/{kernel}", method="DELETE", headers=headers)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])))
