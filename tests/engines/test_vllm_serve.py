"""`draftsmith regenerate` through vLLM (`make test-engines`): a real `vllm serve` of the embedded target on a
free 127.0.0.1 port (`--endpoint`), and vLLM's offline engine in the command's own process (`--engine vllm`),
each against transformers' greedy answers. The server is started once for this module and stopped by its
fixture; the last test stops it mid-run itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.xdist_group("vllm-serve")  # one server and one reference for the module, on one worker

from tests.conftest import run_cli, sample_chats, save_tiny_target  # noqa: E402

TARGET = "embedded:smollm2-135m-instruct"
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
COMMON = ["--target", TARGET, "--max-new-tokens", "32", "--max-length", "512", "--dtype", "float32", "--turns", "all"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "chats.json"
    path.write_text(json.dumps(sample_chats(40, seed=3)))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`vllm serve` (its OpenAI server module: the CPU build's `vllm` script looks for a package named vllm)."""
    from draftsmith.models.sources import resolve_source

    port, log = free_port(), tmp_path_factory.mktemp("serve") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_source(TARGET),
                                 "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
                                 "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--seed", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"vllm serve did not start:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def regenerate(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return run_cli("regenerate", *COMMON, *args, env=ENV, timeout=timeout)


def records(path: Path) -> dict[str, list]:
    return {r["id"]: r["messages"] for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def reference(chats, tmp_path_factory) -> dict[str, list]:
    """transformers' greedy answers (float32) to the first 12 chats, every turn."""
    out = tmp_path_factory.mktemp("serve") / "transformers.jsonl"
    done = regenerate("--data", str(chats), "--limit", "12", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return records(out)


def test_the_served_target_answers_as_transformers_does(server, chats, reference, tmp_path):
    _, url = server
    out = tmp_path / "served.jsonl"
    done = regenerate("--data", str(chats), "--limit", "12", "--out", str(out), "--endpoint", url, "--concurrency", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    served = records(out)
    assert served.keys() == reference.keys() and len(served) == 12
    assert served == reference  # float32 and greedy on both sides: the same tokens, every turn
    assert sum(len(m) // 2 for m in served.values()) > 12  # later turns followed the server's own answers
    # a --target of another tokenizer than the served model's is refused before any chat is sent
    other = save_tiny_target(tmp_path / "other")
    done = run_cli("regenerate", "--target", str(other), "--data", str(chats), "--limit", "2", "--out",
                   str(tmp_path / "x.jsonl"), "--endpoint", url, env=ENV)
    assert done.returncode == 2 and "another tokenizer or chat template" in done.stderr


def test_vllms_offline_engine_answers_as_transformers_does(chats, reference, tmp_path):
    out = tmp_path / "offline.jsonl"
    done = regenerate("--data", str(chats), "--limit", "8", "--out", str(out), "--engine", "vllm",
                      "--engine_args", '{"enforce_eager": true}')  # no graph compile: seconds, not a minute
    assert done.returncode == 0, done.stderr[-3000:]
    offline = records(out)
    assert len(offline) == 8 and offline == {key: reference[key] for key in offline}


def test_a_killed_client_resumes_without_a_lost_or_repeated_chat(server, chats, reference, tmp_path):
    _, url = server
    out = tmp_path / "killed.jsonl"
    args = [sys.executable, "-m", "draftsmith.cli", "regenerate", *COMMON, "--data", str(chats), "--limit", "12",
            "--out", str(out), "--endpoint", url, "--chunk", "4", "--concurrency", "1"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **ENV})
    deadline = time.time() + 300
    while not (out.exists() and len(out.read_text().splitlines()) >= 4) and time.time() < deadline:
        time.sleep(0.2)
    proc.kill()  # mid-chunk: the chats of the unfinished chunk are not in the file
    proc.wait()
    kept = len(out.read_text().splitlines())
    assert 4 <= kept < 12
    done = regenerate("--data", str(chats), "--limit", "12", "--out", str(out), "--endpoint", url, "--chunk", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 12 and records(out) == reference


def test_a_server_stopped_mid_run_is_retried_then_ends_the_run_clearly(server, chats, tmp_path):
    proc, url = server
    out = tmp_path / "stopped.jsonl"
    args = [sys.executable, "-m", "draftsmith.cli", "regenerate", *COMMON, "--data", str(chats), "--limit", "40",
            "--out", str(out), "--endpoint", url, "--chunk", "4", "--concurrency", "2", "--retries", "3",
            "--retry-wait", "0.5"]
    client = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    deadline = time.time() + 300
    while not (out.exists() and out.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the server dies under the client
    proc.wait(60)
    _, err = client.communicate(timeout=120)
    assert client.returncode == 2
    assert "retrying in 0.5 s (try 2 of 4)" in err and "retrying in 2 s (try 4 of 4)" in err
    assert "no answer after 4 tries" in err and "rerun the same command to resume" in err
    lines = out.read_text().splitlines()
    assert 1 <= len(lines) < 40 and all(json.loads(line)["messages"] for line in lines)  # whole records only
