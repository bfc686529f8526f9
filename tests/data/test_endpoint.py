"""`draftsmith regenerate --endpoint`: the client against a small OpenAI-compatible server in this process
(answers, bounded concurrency, retries, refusals, reasoning). tests/engines/test_vllm_serve.py runs the
same client against a real `vllm serve`."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftsmith import DraftsmithError
from draftsmith.jobs.answerers import with_reasoning
from draftsmith.jobs.regenerate import RegenerateConfig, regenerate
from draftsmith.models.target import load_tokenizer
from tests.conftest import save_tiny_target


class Server:
    """Serves /v1/models, /tokenize and /v1/chat/completions for one tokenizer: an answer is the last user
    turn reversed. `fail` holds status codes the next requests answer with (e.g. [503, 503])."""

    def __init__(self, tokenizer, model="tiny", tokenize=True, reasoning=None):
        self.tok, self.model, self.tokenize, self.reasoning = tokenizer, model, tokenize, reasoning
        self.fail, self.requests, self.in_flight, self.most_in_flight = [], [], 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((self.path, body))
                    code = server.fail.pop(0) if server.fail else 200
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                time.sleep(0.02)
                with server.lock:  # done before the reply goes out: the client's next request cannot overlap it
                    server.in_flight -= 1
                self.answer(code, body)

            def answer(self, code, body):
                if code != 200:
                    return self.reply(code, {"error": {"message": f"injected {code}", "code": code}})
                if body.get("model") != server.model:
                    return self.reply(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                ids = server.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
                if self.path == "/tokenize":
                    if not server.tokenize:
                        return self.reply(404, {"detail": "Not Found"})
                    return self.reply(200, {"tokens": list(ids), "count": len(ids)})
                text = body["messages"][-1]["content"][::-1]
                message = {"role": "assistant", "content": text}
                if server.reasoning:
                    message["reasoning_content"] = server.reasoning
                self.reply(200, {"choices": [{"message": message, "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": len(ids), "completion_tokens": len(text.split())}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def chats(self):
        return sum(1 for path, body in self.requests if path == "/v1/chat/completions" and body["max_tokens"] > 1)

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("endpoint-target") / "t")


@pytest.fixture
def server(tiny):
    s = Server(load_tokenizer(str(tiny)))
    yield s
    s.stop()


def cfg(tiny, chats_file, out, url, **kw):
    base = dict(target=str(tiny), data=str(chats_file), out=str(out), endpoint=url, max_new_tokens=12, max_length=256,
                chunk=8, concurrency=3, retry_wait=0.01)
    return RegenerateConfig(**{**base, **kw})


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_endpoint_answers_every_turn_with_bounded_concurrency(tiny, chats_file, server, tmp_path):
    out = tmp_path / "e.jsonl"
    summary = regenerate(cfg(tiny, chats_file, out, server.url, limit=20, turns="all"))
    records = read(out)
    assert summary["conversations"] == 20 and len(records) == 20 and summary["engine"] == server.url
    for r in records:
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert answers == [u[::-1] for u in users]  # each turn answered after the earlier answers
    assert server.chats() == sum(len(r["messages"]) // 2 for r in records)
    assert 1 < server.most_in_flight <= 3  # in parallel, never more than --concurrency


def test_5xx_is_retried_with_backoff_and_4xx_stops_with_the_servers_message(tiny, chats_file, server, tmp_path, capsys):
    from rich.console import Console

    server.fail = [503, 502]
    out = tmp_path / "r.jsonl"
    console = Console(stderr=True, width=40)  # a retry line is one line, however narrow the terminal
    regenerate(cfg(tiny, chats_file, out, server.url, limit=4), console=console)
    assert len(read(out)) == 4
    err = capsys.readouterr().err
    assert "503 Service Unavailable: injected 503; retrying in 0.01 s (try 2 of 6)" in err
    assert "502 Bad Gateway: injected 502; retrying in 0.02 s (try 3 of 6)" in err
    server.fail = [400]
    with pytest.raises(DraftsmithError, match=r"refused the request \(400 Bad Request\): injected 400"):
        regenerate(cfg(tiny, chats_file, out, server.url, limit=8))
    with pytest.raises(DraftsmithError, match="The model `other` does not exist"):
        regenerate(cfg(tiny, chats_file, out, server.url, limit=8, served_model="other"))
    assert len(read(out)) == 4  # what was finished stays


def test_a_server_that_stays_down_ends_the_run_clearly_and_a_rerun_resumes(tiny, chats_file, server, tmp_path):
    out = tmp_path / "down.jsonl"
    regenerate(cfg(tiny, chats_file, out, server.url, limit=8))
    server.fail = [503] * 3
    with pytest.raises(DraftsmithError, match=r"no answer after 3 tries \(last: 503 Service Unavailable: "
                                              r"injected 503\).*rerun the same command to resume"):
        regenerate(cfg(tiny, chats_file, out, server.url, limit=16, retries=2, concurrency=1))
    assert len(read(out)) == 8
    summary = regenerate(cfg(tiny, chats_file, out, server.url, limit=16))
    assert summary["already_done"] == 8 and len({r["id"] for r in read(out)}) == 16
    server.stop()
    with pytest.raises(DraftsmithError, match=r"no answer after 2 tries \(last: .*refused"):
        regenerate(cfg(tiny, chats_file, tmp_path / "gone.jsonl", server.url, limit=2, retries=1))


def test_a_server_of_another_tokenizer_or_template_is_refused(tiny, chats_file, tmp_path):
    other = save_tiny_target(tmp_path / "other", template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    for tokenize in (True, False):  # by its /tokenize, or without one by the prompt's token count
        s = Server(load_tokenizer(str(other)), tokenize=tokenize)
        try:
            with pytest.raises(DraftsmithError, match="another tokenizer or chat template"):
                regenerate(cfg(tiny, chats_file, tmp_path / f"x{tokenize}.jsonl", s.url, limit=2))
        finally:
            s.stop()


def test_reasoning_is_kept_in_front_of_the_answer_or_dropped(tiny, chats_file, tmp_path):
    s = Server(load_tokenizer(str(tiny)), reasoning="primes are odd but 2")
    try:
        regenerate(cfg(tiny, chats_file, tmp_path / "keep.jsonl", s.url, limit=2))
        regenerate(cfg(tiny, chats_file, tmp_path / "drop.jsonl", s.url, limit=2, reasoning="drop"))
    finally:
        s.stop()
    kept, dropped = read(tmp_path / "keep.jsonl")[0]["messages"], read(tmp_path / "drop.jsonl")[0]["messages"]
    assert kept[1]["content"] == f"<think>\nprimes are odd but 2\n</think>\n\n{kept[0]['content'][::-1]}"
    assert dropped[1]["content"] == dropped[0]["content"][::-1]
    # a trace inside the text (a template that opened <think> itself leaves only the closing tag)
    assert with_reasoning("<think>\nhm\n</think>\n\nYes.", None, "drop") == "Yes."
    assert with_reasoning("hm, so\n</think>\n\nYes.", None, "drop") == "Yes."
    assert with_reasoning("Yes.", None, "drop") == with_reasoning("Yes.", None, "keep") == "Yes."
