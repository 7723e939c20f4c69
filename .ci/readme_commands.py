"""Runs the README's Quick start as a newcomer would: in a copy of the project, with a fresh venv and only what
`pip install -e .` brings (no test extra), before the test suite (called by .ci/run; plain Python, no dependencies).

1. The demo command, exactly as written (it makes its own .venv in the copy): it must exit 0 and answer both turns.
2. In that venv: `import qnext, qnext.flax` and then every module of the package's three top-level packages, so a
   module that needs a package only the test extra brings fails here, not on a user's machine.
3. The serve command and its curl, as written but for the port (a free one on 127.0.0.1 instead of 8000): the
   curl must get a chat completion back; the server is then stopped with SIGTERM and must exit.

Exit status 0 when all of it passes; otherwise 1, with the failing command's output."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_START_S = 900           # a cold compilation cache: the server compiles its step shapes before it listens
DEMO_S = 1800                  # venv + pip install + the demo's compile and two turns

IMPORT_EVERY_MODULE = """
import importlib, pkgutil
import qnext, qnext.flax
names = [info.name for top in ("qnext", "pallas_kernels", "cache")
         for info in pkgutil.walk_packages(importlib.import_module(top).__path__, top + ".")
         if not info.name.endswith("__main__")]          # a __main__ module runs its program when imported
for name in names:
    importlib.import_module(name)
print(f"imported {len(names)} modules with the base dependencies only")
"""


def quick_start_blocks(readme: str) -> list[str]:
    """The ```bash blocks of the README's "## Quick start" section, in order."""
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def block_with(blocks: list[str], needle: str) -> str:
    found = [b for b in blocks if needle in b]
    if not found:
        raise SystemExit(f"README.md's Quick start has no bash block with {needle!r}")
    return found[0]


def joined_lines(block: str) -> list[str]:
    """Shell lines with their backslash continuations joined."""
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def project_copy(dest: Path) -> Path:
    """The files git tracks, and the untracked ones it does not ignore, copied to dest (a fresh clone's view)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def newcomer_env() -> dict:
    """This environment less any active venv (CI activates the test venv before calling this)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(venv))
    return env


def run(command: str, cwd: Path, env: dict, timeout: float) -> str:
    print(f"$ {command}", flush=True)
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        print(done.stdout[-6000:], done.stderr[-6000:], sep="\n")
        raise SystemExit(f"README command failed with exit status {done.returncode}: {command}")
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_demo(block: str, cwd: Path, env: dict) -> None:
    out = run(" && ".join(joined_lines(block)), cwd, env, DEMO_S)
    turns = out.count("assistant> ")
    if turns != 2 or "[stats]" not in out:
        print(out[-4000:])
        raise SystemExit(f"the demo answered {turns} turns (expected 2, then its [stats] line)")
    print(f"demo: 2 turns answered; {out.strip().splitlines()[-1]}")


def check_imports(cwd: Path, env: dict) -> None:
    print(run(f". .venv/bin/activate && python -c {shlex.quote(IMPORT_EVERY_MODULE)}", cwd, env, 600).strip())


def check_serve(block: str, cwd: Path, env: dict) -> None:
    port = free_port()
    lines = [re.sub(r"(--port |:)8000\b", rf"\g<1>{port}", line) for line in joined_lines(block)]
    serve, clients = lines[0], lines[1:]
    print(f"$ {serve} &", flush=True)
    log = open(cwd / "serve.log", "w+")
    server = subprocess.Popen(["bash", "-c", serve], cwd=cwd, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_healthy(port, server, log)
        for client in clients:
            reply = json.loads(run(client, cwd, env, 300))
            content = reply["choices"][0]["message"]["content"]
            print(f"curl: {reply['choices'][0]['finish_reason']}, {reply['usage']['completion_tokens']} tokens, "
                  f"{content[:40]!r}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            raise SystemExit("the server did not stop within 60 s of SIGTERM")


def wait_until_healthy(port: int, server: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            print(log.read()[-6000:])
            raise SystemExit(f"the README's serve command exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"the server did not answer /health within {SERVER_START_S} s")


def main() -> int:
    blocks = quick_start_blocks((ROOT / "README.md").read_text())
    with tempfile.TemporaryDirectory(prefix="qnext-readme-") as tmp:
        cwd = project_copy(Path(tmp))
        env = newcomer_env()
        check_demo(block_with(blocks, "scripts/generate.py"), cwd, env)
        check_imports(cwd, env)
        check_serve(block_with(blocks, "qnext serve"), cwd, env)
    print("README quick start: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
