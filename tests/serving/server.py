"""`jaxformer-serve` started for real in a subprocess, on a free loopback port, as
the server tests talk to it: with the official `openai` client, or raw HTTP."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

KEY = "test-key-1234"
NAME = "tiny-chat"


class Server:
    """`jaxformer-serve` in a subprocess, on a free loopback port; its stderr in a file."""

    def __init__(self, folder: str, log_path: str, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxformer.commands.serve", "--checkpoint", folder, "--port", str(self.port),
             "--model-name", NAME, "--api-key", KEY, *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"the server did not come up in 180 s:\n{self.log()}")

    def client(self, **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60, **kwargs)

    def post(self, path: str, **kwargs) -> "httpx.Response":
        headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=60, **kwargs)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        status = self.process.wait(60)
        self._log.close()
        return status
