#!/usr/bin/env python3
"""Runs every CPU command that README.md and docs/*.md show, as written, and fails when one
fails or when running them changed the checkout (`git status --porcelain`).

A fenced block whose info string is `sh` is run; `sh gpu` (needs a GPU, the CUDA toolchain or
the real checkpoint) and `sh slow` (a benchmark that runs for many minutes, or a second build
of the workspace) are shown to the reader but not run here. `cargo test --workspace` and the
CUDA toolchain and compile gates are left to CI's own steps, which run exactly them.

Two things differ from a reader's run, to spare CI a second build: `cargo run --release` runs
the debug build CI has already made, and `target/release/` binaries are those of
`target/debug/`, with `target/debug` first on PATH for the pages that write `model` alone. A `serve` command is started in the background; the block's next commands
run once its `/health` answers 200, and it is stopped at the end of the block.

    scripts/readme-commands.py [--list] [FILE...]
"""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIPPED_TAGS = {"gpu", "slow"}
LEFT_TO_CI = re.compile(
    r"^(cargo test --workspace|scripts/cuda-toolchain\.sh|scripts/compile-gates\.sh)(\s|$)")
SERVE = re.compile(r"(^|\s)serve(\s|$)")
COMMAND_LIMIT_S = 900
HEALTH_LIMIT_S = 600


def blocks(path):
    """(first line number, info words, commands) of each fenced block."""
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if not fence or not fence.group(1):
            i += 1
            continue
        start, lang, tags = i + 1, fence.group(1), set(fence.group(2).split())
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang == "sh":
            yield start, tags, commands(body)


def commands(body):
    """Shell commands of a block: comments dropped, continuation lines joined."""
    out, current = [], ""
    for raw in body:
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        out.append(current.strip())
        current = ""
    if current:
        out.append(current.strip())
    return out


def as_run_here(command):
    command = re.sub(r"\bcargo run --release\b", "cargo run", command)
    return command.replace("target/release/", "target/debug/")


def port_of(command):
    match = re.search(r"--port[ =](\d+)", command)
    return int(match.group(1)) if match else 8000


def wait_for_health(port, server):
    deadline = time.monotonic() + HEALTH_LIMIT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"/health on port {port} did not answer 200 within {HEALTH_LIMIT_S} s")


def stop(server):
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def git_status():
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout


def main(argv):
    listing = "--list" in argv
    files = [Path(a) for a in argv if a != "--list"] or [ROOT / "README.md"] + sorted(
        (ROOT / "docs").glob("*.md"))
    os.environ["PATH"] = f"{ROOT / 'target' / 'debug'}{os.pathsep}{os.environ['PATH']}"
    before = git_status()
    ran = skipped = 0
    failures = []
    for path in files:
        for line, tags, block in blocks(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if tags & SKIPPED_TAGS:
                skipped += len(block)
                if listing:
                    for c in block:
                        print(f"skip ({' '.join(sorted(tags))}) {where}: {c}")
                continue
            server = None
            try:
                for command in block:
                    if LEFT_TO_CI.match(command):
                        continue
                    if listing:
                        print(f"run {where}: {command}")
                        continue
                    here = as_run_here(command)
                    print(f"== {where}: {command}", flush=True)
                    ran += 1
                    if SERVE.search(command) and server is None:
                        server = subprocess.Popen(
                            here, shell=True, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        wait_for_health(port_of(command), server)
                        continue
                    result = subprocess.run(
                        ["bash", "-o", "pipefail", "-ec", here], cwd=ROOT,
                        capture_output=True, text=True, timeout=COMMAND_LIMIT_S)
                    if result.returncode != 0:
                        failures.append(
                            f"{where}: `{command}` exited {result.returncode}\n"
                            f"{result.stdout[-2000:]}{result.stderr[-3000:]}")
                        break
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failures.append(f"{where}: {e}")
            finally:
                if server is not None:
                    stop(server)
    if listing:
        return 0
    after = git_status()
    if after != before:
        failures.append(
            "the documented commands changed the checkout:\n"
            + "".join(f"  {l}\n" for l in sorted(set(after.splitlines()) - set(before.splitlines()))))
    print(f"{ran} documented commands ran, {skipped} were shown only (gpu or slow), "
          f"{len(failures)} failed")
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
